"""`jaxpi plan`: abstract compile of a sharded step, memory per device, collectives (8 virtual devices)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sharding.hlo import count_collectives


def run_plan(*args: str) -> subprocess.CompletedProcess:
    # A fresh process: the planner must set XLA_FLAGS (device count) before jax starts its backend.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def tiny_plans():
    proc = run_plan(
        "--model",
        "tiny",
        "--mesh",
        "fsdp=4,tensor=2",
        "--compare",
        "dp,fsdp,tp,fsdp_tp",
        "--seq-len",
        "32",
        "--dtype",
        "float32",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["request"]["strategy"]: r for r in json.loads(proc.stdout)}


def test_argument_bytes_compiled_equal_analytic(tiny_plans):
    for name, r in tiny_plans.items():
        assert r["devices"] == 8
        assert r["compiled"]["argument"] == r["analytic"]["argument"], name
        assert r["peak_bytes"] >= r["compiled"]["argument"]


def test_strategies_split_what_they_declare(tiny_plans):
    dp, fsdp, tp, both = (tiny_plans[k] for k in ("dp", "fsdp", "tp", "fsdp_tp"))
    # dp replicates the weights; fsdp splits them 4 ways, tp 2 ways, fsdp_tp 8 ways (up to the
    # small replicated tensors: norms, biases of the gates).
    assert fsdp["analytic"]["params"] < 0.4 * dp["analytic"]["params"]
    assert tp["analytic"]["params"] < 0.7 * dp["analytic"]["params"]
    assert both["analytic"]["params"] < fsdp["analytic"]["params"]
    # Collectives: only weight-sharding over the batch axes gathers weights; dp all-reduces grads.
    assert dp["collectives"]["all-gather"]["count"] == 0
    assert dp["collectives"]["all-reduce"]["bytes"] > 0
    assert fsdp["collectives"]["all-gather"]["count"] > 0
    assert tp["collectives"]["all-reduce"]["count"] > dp["collectives"]["all-reduce"]["count"]
    assert tp["global_batch"] == 4 and fsdp["global_batch"] == 4 and dp["global_batch"] == 4


def test_plan_table_and_device_memory_verdict():
    proc = run_plan(
        "--model",
        "tiny",
        "--mesh",
        "fsdp=2",
        "--seq-len",
        "16",
        "--lora-rank",
        "4",
        "--device-memory",
        "1MiB",
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # does not fit in 1 MiB
    assert "LoRA rank 4" in proc.stdout and "NO" in proc.stdout and "temp /dev" in proc.stdout


def test_plan_errors_are_clear():
    proc = run_plan("--model", "tiny", "--mesh", "fsdp=2", "--strategy", "zero9")
    assert proc.returncode == 2 and "unknown sharding strategy" in proc.stderr
    proc = run_plan("--model", "tiny")
    assert proc.returncode == 2 and "--mesh" in proc.stderr


def test_hlo_collectives_are_counted_per_loop_iteration():
    code = textwrap.dedent(
        """
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, json
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        from sharding.hlo import count_collectives
        mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
        w = jax.ShapeDtypeStruct((4, 64, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp", None)))
        x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
        def f(w, x):
            body = lambda h, wi: (jnp.tanh(h @ wi @ wi.T), None)
            return jnp.sum(jax.lax.scan(body, x, w)[0])
        text = jax.jit(jax.grad(f)).lower(w, x).compile().as_text()
        print(json.dumps(count_collectives(text).to_json()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    # Each of the 4 scanned layers gathers its weight shard (twice: both matmuls) in the forward and
    # again in the backward: 16 gathers of a full [64, 32] float32 weight.
    assert got["all-gather"]["count"] % 4 == 0 and got["all-gather"]["count"] >= 8
    assert got["all-gather"]["bytes"] == got["all-gather"]["count"] * 64 * 32 * 4


def test_hlo_parser_needs_an_entry():
    with pytest.raises(ValueError, match="ENTRY"):
        count_collectives("%foo (a: f32[]) -> f32[] {\n}\n")
