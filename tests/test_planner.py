"""`jaxpi plan`: abstract compile of a sharded step, memory per device, collectives (8 virtual devices)."""

import json
import subprocess
import sys
import textwrap

import pytest

from jaxpi.testing.xla import child_env
from sharding.hlo import count_collectives


def run_plan(*args: str) -> subprocess.CompletedProcess:
    # A fresh process: the planner must set XLA_FLAGS (device count) before jax starts its backend.
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


TINY_8 = ("--model", "tiny", "--mesh", "fsdp=4,tensor=2", "--seq-len", "32", "--dtype", "float32", "--json")


@pytest.fixture(scope="module")
def tiny_plans():
    # fsdp_tp, the fourth strategy, is compiled in the slow test below.
    proc = run_plan(*TINY_8, "--compare", "dp,fsdp,tp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["request"]["strategy"]: r for r in json.loads(proc.stdout)}


LORA_27B = ("--model", "qwen3_5_27b", "--mesh", "fsdp=64", "--strategy", "fsdp", "--lora-rank", "32")


def test_27b_adapters_and_adam_are_split_over_64_devices():
    """Rank 32 on fsdp=64 kept 614 MB of adapters and 1.23 GB of Adam state on every device
    before the adapters were split (sharding.strategies.adapter_spec), 193 MB and 385 MB while
    head_dim was never split; now 15.2 MB and 30.3 MB (docs/sharding.md)."""
    proc = run_plan(*LORA_27B, "--no-compile", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    plan = (out[0] if isinstance(out, list) else out)["analytic"]
    assert plan["trainable"] + plan["optimizer"] <= 50e6, plan


@pytest.mark.slow  # one 27B compile for 64 devices: 47-90 s on the 2-core machine
def test_27b_adapters_and_adam_are_split_over_64_devices_compiled():
    """The compiled step's argument bytes per device equal the analytic ones to the byte, so the
    compiled step holds the split adapters: what is not the frozen base is at most 50 MB."""
    proc = run_plan(*LORA_27B, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    analytic = plan["analytic"]
    assert plan["compiled"]["argument"] == analytic["argument"]
    base = analytic["params"] - analytic["trainable"]
    assert plan["compiled"]["argument"] - base <= 50e6, plan


def test_tiny_lora_plan_splits_adapters_compiled_as_analytic():
    """The compiled step holds the split adapters the analytic plan counts: fsdp=8 keeps 0.131 of
    dp's adapter and Adam bytes (measured; 1/8 would be 0.125: B of in_proj_a and in_proj_b, whose
    only dimension beside the rank is 6 heads, stay whole), and the compiled argument bytes equal
    the analytic. (0.40 while head_dim was never split.)"""
    proc = run_plan(
        "--model", "tiny", "--mesh", "fsdp=8", "--seq-len", "32", "--dtype", "float32",
        "--lora-rank", "4", "--compare", "dp,fsdp", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    dp, fsdp = (r["analytic"] | {"compiled": r["compiled"]} for r in json.loads(proc.stdout))
    for plan in (dp, fsdp):
        assert plan["compiled"]["argument"] == plan["argument"]
    assert fsdp["trainable"] < 0.14 * dp["trainable"] and fsdp["optimizer"] < 0.14 * dp["optimizer"]


def test_argument_bytes_compiled_equal_analytic(tiny_plans):
    for name, r in tiny_plans.items():
        assert r["devices"] == 8
        assert r["compiled"]["argument"] == r["analytic"]["argument"], name
        assert r["peak_bytes"] >= r["compiled"]["argument"]


def test_strategies_split_what_they_declare(tiny_plans):
    dp, fsdp, tp = (tiny_plans[k] for k in ("dp", "fsdp", "tp"))
    # dp replicates the weights; fsdp splits them 4 ways, tp 2 ways (up to the small replicated
    # tensors: norms, biases of the gates).
    assert fsdp["analytic"]["params"] < 0.4 * dp["analytic"]["params"]
    assert tp["analytic"]["params"] < 0.7 * dp["analytic"]["params"]
    # Collectives: only weight-sharding over the batch axes gathers weights; dp all-reduces grads.
    assert dp["collectives"]["all-gather"]["count"] == 0
    assert dp["collectives"]["all-reduce"]["bytes"] > 0
    assert fsdp["collectives"]["all-gather"]["count"] > 0
    assert tp["collectives"]["all-reduce"]["count"] > dp["collectives"]["all-reduce"]["count"]
    assert tp["global_batch"] == 4 and fsdp["global_batch"] == 4 and dp["global_batch"] == 4


@pytest.mark.slow
def test_fsdp_tp_splits_both_ways(tiny_plans):
    proc = run_plan(*TINY_8, "--strategy", "fsdp_tp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = json.loads(proc.stdout)
    assert both["devices"] == 8 and both["compiled"]["argument"] == both["analytic"]["argument"]
    # 8 ways (fsdp 4 x tensor 2) against fsdp's 4.
    assert both["analytic"]["params"] < tiny_plans["fsdp"]["analytic"]["params"]
    assert both["collectives"]["all-gather"]["count"] > 0


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
        "64KiB",
        "--remat",
        "mlp",
        "--loss-chunk",
        "8",
        "--attn-impl",
        "pallas",
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # does not fit in 64 KiB
    assert "LoRA rank 4" in proc.stdout and "NO" in proc.stdout and "temp /dev" in proc.stdout
    assert "remat mlp  loss_chunk 8  attn_impl pallas" in proc.stdout.splitlines()[0]


def test_plan_errors_are_clear():
    proc = run_plan("--model", "tiny", "--mesh", "fsdp=2", "--strategy", "zero9")
    assert proc.returncode == 2 and "unknown sharding strategy" in proc.stderr
    from jaxpi.plan import PlanRequest  # leaves this process's XLA_FLAGS alone

    with pytest.raises(ValueError, match="loss_chunk must be >= 0"):
        PlanRequest(model="tiny", loss_chunk=-1)
    with pytest.raises(ValueError, match="remat 'some' is not one of"):
        PlanRequest(model="tiny", remat="some")
    with pytest.raises(ValueError, match="attn_impl 'flash' is not one of"):
        PlanRequest(model="tiny", attn_impl="flash")
    with pytest.raises(ValueError, match="gdn_impl 'triton' is not one of"):
        PlanRequest(model="tiny", gdn_impl="triton")
    proc = run_plan("--model", "tiny")
    assert proc.returncode == 2 and "--mesh" in proc.stderr


# Memory levers on one device: tiny in float32 at T = 128, where the float32 logits (V = 512) are
# an eighth of the temporaries. "policy:loss_chunk[:attn_impl]" -> plan JSON, all from one process
# (about 7 s of compile each: the dots policies are in the slow test).
LEVERS = ("full:0", "mlp:0", "full:16", "none:0", "none:0:pallas")
LEVERS_SLOW = ("dots:0", "dots_no_batch:0")


def plan_levers(specs: tuple[str, ...]) -> dict[str, dict]:
    code = textwrap.dedent(
        """
        import json, os, sys
        from jaxpi.plan import PlanRequest, plan, planner_xla_flags
        os.environ["XLA_FLAGS"] = planner_xla_flags(1)  # before the backend starts
        out = {}
        for spec in sys.argv[1:]:
            remat, chunk, *attn = spec.split(":")
            req = PlanRequest(model="tiny", mesh="fsdp=1", seq_len=128, dtype="float32", remat=remat,
                              loss_chunk=int(chunk), attn_impl=attn[0] if attn else "jax")
            out[spec] = plan(req, progress=False).to_json()
        print(json.dumps(out))
        """
    )
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", code, *specs], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def lever_plans():
    return plan_levers(LEVERS)


def temps(plans: dict[str, dict], spec: str) -> tuple[int, int]:
    return plans[spec]["compiled"]["temp"], plans[spec]["analytic"]["temp"]


def assert_analytic_tracks_compiled(plans: dict[str, dict]) -> None:
    # Measured compiled / analytic temp (jax 0.10.2, XLA:CPU): none 1.04, full 0.96, mlp 0.96,
    # full + loss_chunk 16 1.00, dots 0.85, dots_no_batch 0.90.
    for spec in plans:
        compiled, analytic = temps(plans, spec)
        assert 0.8 <= compiled / analytic <= 1.25, (spec, compiled, analytic)


def test_loss_chunk_lowers_compiled_and_analytic_temp(lever_plans):
    (c0, a0), (c16, a16) = temps(lever_plans, "full:0"), temps(lever_plans, "full:16")
    assert lever_plans["full:16"]["request"]["loss_chunk"] == 16
    # 16 positions' logits live instead of 128: at least one float32 [112, 512] array fewer
    # (measured: 309 KiB fewer compiled, 449 KiB analytic).
    assert c0 - c16 >= 112 * 512 * 4, (c0, c16)
    assert a0 - a16 >= 112 * 512 * 4, (a0, a16)


def test_remat_policies_order_compiled_and_analytic_alike(lever_plans):
    # mlp keeps two [T, F] arrays per layer on top of full's unit inputs (measured 4.06 < 4.45 MB
    # compiled); the chunked loss is lowest. The analytic figures put the three in the same order.
    order = ["full:16", "full:0", "mlp:0"]
    assert sorted(order, key=lambda s: temps(lever_plans, s)[0]) == order
    # Strictly, with room (measured full / mlp 0.91): without the planner's memory-minimising
    # scheduler flag XLA:CPU recomputes during the forward and full compiles above mlp (1.01).
    assert temps(lever_plans, "full:0")[0] < 0.95 * temps(lever_plans, "mlp:0")[0]
    assert sorted(order, key=lambda s: temps(lever_plans, s)[1]) == order
    assert_analytic_tracks_compiled(lever_plans)


def test_flash_attention_keeps_no_scores_compiled_and_analytic(lever_plans):
    # Without remat the blocked core keeps every query block's float32 scores and probabilities
    # for the backward: 4 heads x 128 x 128 x 8 bytes on tiny at T = 128 (one attention layer).
    # Flash attention (compiled on CPU in Pallas' interpreter) keeps a log-sum-exp per query
    # instead (measured: 524,032 bytes fewer compiled, 608,256 analytic).
    scores = 4 * 128 * 128 * 8
    (cj, aj), (cf, af) = temps(lever_plans, "none:0"), temps(lever_plans, "none:0:pallas")
    assert lever_plans["none:0:pallas"]["request"]["attn_impl"] == "pallas"
    assert cj - cf >= 0.9 * scores, (cj, cf)
    assert aj - af >= 0.9 * scores, (aj, af)
    assert_analytic_tracks_compiled({k: lever_plans[k] for k in ("none:0", "none:0:pallas")})


@pytest.mark.slow
def test_every_remat_policy_orders_and_tracks_compiled(lever_plans):
    plans = {**lever_plans, **plan_levers(LEVERS_SLOW)}
    # mlp lies between full and none; dots saves more than dots_no_batch (the batched attention
    # and delta-rule products), which saves more than mlp (measured, MB: 4.06 full < 4.45 mlp <
    # 4.68 dots_no_batch < 5.47 dots < 7.45 none).
    order = ["full:0", "mlp:0", "dots_no_batch:0", "dots:0", "none:0"]
    assert sorted(order, key=lambda s: temps(plans, s)[0]) == order
    assert sorted(order, key=lambda s: temps(plans, s)[1]) == order
    assert_analytic_tracks_compiled(plans)


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


def test_no_compile_gives_the_compiled_runs_analytic_figures(tiny_plans):
    # --no-compile skips only the XLA compile: the analytic figures are the same numbers, and the
    # peak / verdict come from them.
    proc = run_plan(*TINY_8, "--strategy", "fsdp", "--no-compile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["compiled"] is None and r["collectives"] is None and r["compile_seconds"] == 0.0
    assert r["analytic"] == tiny_plans["fsdp"]["analytic"]
    assert r["collectives_analytic"] == tiny_plans["fsdp"]["collectives_analytic"]
    assert r["peak_bytes"] == r["analytic"]["argument"] + r["analytic"]["temp"]
