"""`jaxpi bench`: the analytic FLOP count against a hand count, the model and XLA; every subcommand
run through the CLI on the tiny config, checking that the report's fields are present and sane;
the profile's op-time summary on a hand-written HLO and trace (a real traced step is `slow`).

Speed is measured, never asserted: the figures only have to be finite, positive, ordered
(min ≤ median ≤ max) and consistent with each other.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpi import cli
from jaxpi.bench import gpu
from jaxpi.bench.compile import abstract_step
from jaxpi.bench.config import make_config
from jaxpi.bench.flops import lora_params, matmul_params, train_step_flops
from jaxpi.bench.gpu_flags import add_arguments
from jaxpi.bench.table import format_table
from jaxpi.config import FULL, LINEAR, TINY

# One layer of each type: d 64, I 128, attention 4 q / 2 kv heads of 32, DeltaNet 2 k / 6 v
# heads of 16, vocab 512, chunk 16.
TWO = TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL))
COMMON = ["--preset", "tiny", "--seq", "32", "--repeats", "2", "--warmup", "1", "--json"]


def test_flops_match_a_hand_count():
    # attention: q+gate 64·4·64, k and v 2·64·2·32, o 4·32·64
    attn = 64 * 4 * 64 + 2 * 64 * 2 * 32 + 4 * 32 * 64
    # DeltaNet: in_proj_qkv 64·(16·2 + 16·2 + 16·6), z 64·96, b and a 2·64·6, out 96·64
    gdn = 64 * 160 + 64 * 96 + 2 * 64 * 6 + 96 * 64
    mlp = 3 * 64 * 128
    head = 64 * 512
    assert matmul_params(TWO) == attn + gdn + 2 * mlp + head == 137_984
    r = 4
    lora_attn = r * ((64 + 256) + 2 * (64 + 64) + (128 + 64))
    lora_gdn = r * ((64 + 160) + (64 + 96) + 2 * (64 + 6) + (96 + 64))
    lora_mlp = r * (2 * (64 + 128) + (128 + 64))
    assert lora_params(TWO, r) == lora_attn + lora_gdn + 2 * lora_mlp

    f = train_step_flops(TWO, seq=32, batch=2, lora_rank=r)
    t = 64  # tokens
    expected = {
        "projections": 4 * (attn + gdn + 2 * mlp) * t,
        "lm_head": 4 * head * t,
        "lora": 6 * lora_params(TWO, r) * t,
        "attention": 3 * 2 * (2 * 32 * 32 * 4 * 32),  # batch 2, causal half of QKᵀ and PV
        "deltanet": 3 * 2 * t * 6 * (16 * (3 * 16 + 2 * 16) + 3 * 16 * 16),
    }
    assert f["parts"] == pytest.approx(expected)
    assert f["total"] == pytest.approx(sum(expected.values()))


def test_flop_counts_match_the_model_parameters():
    """P and P_lora counted from the config equal the real model's matmul and adapter weights."""
    from jaxpi.lora import LoraConfig, LoRAParam

    step_inputs = abstract_step(make_config("tiny", layers=4, seq=32), 4)[1]
    params = step_inputs[0]
    frozen = lora = 0
    for path, var in nnx.to_flat_state(params):
        name, n = str(path[-1]), math.prod(var.get_value().shape)
        if isinstance(var, LoRAParam):
            lora += n
        elif var.get_value().ndim >= 2 and name != "embed" and not name.startswith("conv"):
            frozen += n
    cfg = TINY.replace(num_hidden_layers=4)
    assert frozen == matmul_params(cfg)
    assert lora == lora_params(cfg, make_config("tiny").lora_rank)
    assert LoraConfig().targets  # every linear target is adapted, as the bench does


def _run(capsys, *argv: str) -> dict:
    assert cli.main(["bench", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _check_figure(fig: dict, repeats: int = 2) -> None:
    assert fig["repeats"] == repeats == len(fig["values"])
    assert all(math.isfinite(v) and v > 0 for v in fig["values"])
    assert fig["min"] <= fig["median"] <= fig["max"]


@pytest.fixture(scope="module")
def reports() -> dict:
    return {}


def test_train_step_vs_torch(capsys, reports):
    rep = _run(capsys, "train-step", *COMMON, "--vs", "torch", "--peak-n", "128")
    reports["train-step"] = rep
    env = rep["env"]
    assert env["threads"] >= 1 and env["jax"] == jax.__version__ and env["torch"] and env["peft"]
    r = rep["results"]["train_step"]
    j, t = r["jaxpi"], r["torch"]
    for fig in (j["step_s"], j["tokens_per_s"], j["flop_per_s"], j["mfu"], t["step_s"], t["tokens_per_s"]):
        _check_figure(fig)
    _check_figure(r["peak"]["flop_per_s"], repeats=3)
    # on the CPU the MFU denominator is the wall-clock figure (no kernel-timed probe)
    assert r["peak"]["mfu_peak"] == r["peak"]["flop_per_s"]["median"] and "kernel_timed" not in r["peak"]
    assert 0 < j["mfu"]["median"] < 1.5 and 0 < t["mfu"] < 1.5
    assert j["compile_s"] > 0
    # XLA's cost analysis of the compiled step counts every op (elementwise, the full score
    # matrix, the DeltaNet inverse), so it lands a little above the model FLOPs: 1.08× measured
    # on these 4 tiny layers (unscanned; XLA counts a scanned loop body once, not per trip).
    assert 0.9 <= j["xla_flops_per_step"] / r["flops"]["total"] <= 1.5
    # tokens/s and FLOP/s of each repeat are the step's tokens and model FLOPs over its time
    assert r["flops"]["total"] == pytest.approx(
        train_step_flops(TINY, seq=32, batch=1, lora_rank=rep["config"]["lora_rank"])["total"]
    )
    for tok, fl, s in zip(
        j["tokens_per_s"]["values"], j["flop_per_s"]["values"], j["step_s"]["values"], strict=True
    ):
        assert tok == pytest.approx(32 / s) and fl == pytest.approx(r["flops"]["total"] / s)
    assert r["speedup_tokens_per_s"] == pytest.approx(
        j["tokens_per_s"]["median"] / t["tokens_per_s"]["median"]
    )
    # Interleaved repeats: pair i is torch repeat i over jaxpi repeat i, each jaxpi repeat has the
    # matmul peak probed right before it, and its adjacent MFU is against that peak.
    assert r["interleaved"] is True
    _check_figure(r["speedup_pairs"])
    _check_figure(j["peak_adjacent"])
    _check_figure(j["mfu_adjacent"])
    assert j["peak_adjacent_source"] == "wall"
    for pair, ts, js in zip(
        r["speedup_pairs"]["values"], t["step_s"]["values"], j["step_s"]["values"], strict=True
    ):
        assert pair == pytest.approx(ts / js)
    for m, pk, s in zip(
        j["mfu_adjacent"]["values"], j["peak_adjacent"]["values"], j["step_s"]["values"], strict=True
    ):
        assert m == pytest.approx(r["flops"]["total"] / s / pk)
    # Same checkpoint, tokens and zero-initialised B: the first step's loss is the base model's in both.
    assert j["loss_first"] == pytest.approx(t["loss_first"], rel=1e-5)
    assert t["lora_params"] == r["flops"]["lora_params"]


@pytest.mark.slow  # interpreted Pallas; the kernels' own tests (tests/test_pallas_*.py) run in make test
def test_train_step_on_the_pallas_kernels(capsys, reports):
    """`--kernels pallas`: the same step on the Pallas gated delta rule, norms and flash attention
    (interpreted on CPU), the same checkpoint and tokens as the plain run above, so the same first
    loss (the kernels' gradients are held to the plain path's in tests/test_pallas_*.py)."""
    rep = _run(
        capsys, "train-step", *COMMON[:4], "--repeats", "1", "--warmup", "1", "--json", "--kernels", "pallas"
    )
    m = rep["config"]["model"]
    assert m["gdn_impl"] == m["norm_impl"] == m["attn_impl"] == "pallas"
    assert reports["train-step"]["config"]["model"]["gdn_impl"] == "jax"
    plain = reports["train-step"]["results"]["train_step"]["jaxpi"]
    got = rep["results"]["train_step"]["jaxpi"]
    assert got["loss_first"] == pytest.approx(plain["loss_first"], rel=1e-6)
    assert math.isfinite(got["loss_last"]) and got["loss_last"] != got["loss_first"]


def test_gdn_vs_torch(capsys, reports):
    rep = _run(capsys, "gdn", *COMMON)
    reports["gdn"] = rep
    g = rep["results"]["gdn"]
    for side in ("jaxpi", "torch"):
        _check_figure(g[side]["fwd_s"])
        _check_figure(g[side]["fwd_bwd_s"])
    assert g["speedup_fwd"] == pytest.approx(g["torch"]["fwd_s"]["median"] / g["jaxpi"]["fwd_s"]["median"])
    assert g["speedup_fwd_bwd"] == pytest.approx(
        g["torch"]["fwd_bwd_s"]["median"] / g["jaxpi"]["fwd_bwd_s"]["median"]
    )
    assert g["max_abs_diff"] < 1e-4  # same inputs, fp32: the two kernels compute the same thing
    assert g["shape"] == {"batch": 1, "seq": 32, "heads": 6, "dk": 16, "dv": 16, "chunk": 16}


def test_decode(capsys, reports):
    rep = _run(capsys, "decode", *COMMON, "--batches", "1,2", "--new-tokens", "4", "--prompt-len", "3")
    reports["decode"] = rep
    d = rep["results"]["decode"]
    assert set(d["batches"]) == {"1", "2"} and d["vs"] == "none"
    _check_figure(d["bandwidth"]["bytes_per_s"], repeats=3)
    for b, v in d["batches"].items():
        j = v["jaxpi"]
        assert j["generated_tokens"] == 4 * int(b) and "vllm" not in v
        for fig in (
            j["call_s"],
            j["tokens_per_s"],
            j["steps_per_s"],
            j["bandwidth_fraction"],
            v["bandwidth_adjacent"],
        ):
            _check_figure(fig)
        assert j["tokens_per_s"]["max"] == pytest.approx(j["generated_tokens"] / j["call_s"]["min"])
        # each repeat's bandwidth: the mean of the probes right before its call and right after its
        # one-token call
        probes = v["bandwidth_probes"]
        assert (
            len(probes["before"]) == len(probes["after"]) == 2 and min(probes["before"] + probes["after"]) > 0
        )
        assert v["bandwidth_adjacent"]["values"] == pytest.approx(
            [(a + z) / 2 for a, z in zip(probes["before"], probes["after"], strict=True)]
        )
        # fraction of each repeat = bytes per step x that repeat's steps/s / the probes around it
        total = v["bytes_per_step"]["total"]
        for f, s, bw in zip(
            j["bandwidth_fraction"]["values"],
            j["call_s"]["values"],
            v["bandwidth_adjacent"]["values"],
            strict=True,
        ):
            assert f == pytest.approx(total * (4 / s) / bw)
        assert 0 < j["bandwidth_fraction"]["median"] < 1
        # per decode step: each call less the one-token call after it, over the other 3 steps
        _check_figure(j["one_token_call_s"])
        for f, step, s, s1, bw in zip(
            j["bandwidth_fraction_per_step"]["values"],
            j["decode_step_s"]["values"],
            j["call_s"]["values"],
            j["one_token_call_s"]["values"],
            v["bandwidth_adjacent"]["values"],
            strict=True,
        ):
            assert step == pytest.approx((s - s1) / 3) and f == pytest.approx(total / step / bw)
    assert rep["env"]["cpu_model"] is None or isinstance(rep["env"]["cpu_model"], str)


def test_step_bytes_count_weights_once_and_the_cache_rows():
    """Against a hand count on TWO (one DeltaNet, one attention layer; fp32): every weight but the
    embedding table, one embedding row per row, the attention cache's read positions plus one
    written, the DeltaNet conv window and state read and written whole."""
    from jaxpi.bench.decode import step_bytes
    from jaxpi.hf_fixtures import random_jax_model

    model = random_jax_model(TWO, 0, "float32")
    b, ctx = 3, 10.5
    got = step_bytes(model, batch=b, context=ctx, max_len=40)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert got["weights"] == 4 * (params - 512 * 64)
    assert got["embedding_rows"] == 4 * b * 64
    kv_position = 2 * b * 2 * 32 * 4  # k and v, 2 kv heads of 32, fp32
    assert got["kv_read"] == kv_position * ctx and got["kv_write"] == kv_position
    conv = b * 3 * (2 * 2 * 16 + 6 * 16) * 4  # 3 past taps of q, k (2 heads of 16) and v (6 heads)
    state = b * 6 * 16 * 16 * 4  # float32 [B, Hv, Dk, Dv]
    assert got["recurrent_state_read_write"] == 2 * (conv + state)
    assert got["total"] == pytest.approx(sum(v for k, v in got.items() if k != "total"))
    # tied embeddings: the LM head reads the whole table, so it counts as a weight
    tied = random_jax_model(TWO.replace(tie_word_embeddings=True), 0, "float32")
    t = step_bytes(tied, batch=b, context=ctx, max_len=40)
    assert t["embedding_rows"] == 0 and t["weights"] == 4 * sum(
        x.size for x in jax.tree.leaves(nnx.state(tied, nnx.Param))
    )


def test_bandwidth_probe_and_greedy_agreement():
    from jaxpi.bench.bandwidth import bandwidth_probe, copy_bandwidth
    from jaxpi.bench.decode import greedy_agreement

    probe = bandwidth_probe(1 << 20)
    assert 1e8 < probe() < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s
    c = copy_bandwidth(1 << 20, repeats=2)
    assert c["bytes_per_call"] == 2 * (1 << 20)
    _check_figure(c["bytes_per_s"])
    with pytest.raises(ValueError, match="at least 4096"):
        bandwidth_probe(64)
    g = greedy_agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert g == {
        "rows": 3,
        "rows_identical": 1,
        "mean_common_prefix": pytest.approx(4 / 3),
        "min_common_prefix": 0,
    }


def test_decode_profile_sums_the_loop_by_model_part(capsys, tmp_path):
    rep = _run(
        capsys,
        "profile",
        "--mode",
        "decode",
        "--preset",
        "tiny",
        "--batch",
        "2",
        "--new-tokens",
        "4",
        "--steps",
        "1",
        "--trace-dir",
        str(tmp_path),
        "--json",
    )
    p = rep["results"]["profile"]
    assert p["mode"] == "decode" and p["steps"] == 4 and p["batch"] == 2
    assert (tmp_path / "decode.hlo.txt").exists()
    # the decode program's ops, in the loop's parts; the matrix-vector dots XLA makes without
    # metadata too, so little is left unmatched but the spans of the nested loops (the sampler's)
    parts = {"mlp", "deltanet: recurrent step", "sampling (log-softmax, argmax / draw)"}
    assert parts | {"LM head (and the engine's copy of its logits)"} <= set(p["parts"])
    ops = [u for u in p["top_unmatched"] if not u["name"].startswith(("while", "call", "conditional"))]
    assert sum(u["s"] for u in ops) < 0.1 * p["op_seconds_per_step"]
    assert sum(v["share"] for v in p["parts"].values()) == pytest.approx(1.0)
    assert 0 < p["busy_seconds_per_step"] <= p["wall_seconds_per_step"]
    assert p["bytes_per_step"]["total"] > p["bytes_per_step"]["weights"] > 0
    assert "decode loop at batch 2" in format_table(rep)


def test_compile(capsys, reports):
    rep = _run(capsys, "compile", *COMMON, "--layers", "1,2", "--seq", "16")
    reports["compile"] = rep
    c = rep["results"]["compile"]
    assert set(c["layers"]) == {"1", "2"}
    for v in c["layers"].values():
        for k in ("lower_s", "compile_s", "total_s"):
            _check_figure(v[k])
    ratio = c["layers"]["2"]["total_s"]["median"] / c["layers"]["1"]["total_s"]["median"]
    assert c["ratio_deepest_over_shallowest"] == pytest.approx(ratio)


def test_human_table_names_every_figure(reports):
    if len(reports) < 4:
        pytest.skip("needs the reports of the subcommand tests above")
    merged = dict(reports["train-step"], command="all")
    merged["results"] = {k: v for r in reports.values() for k, v in r["results"].items()}
    text = format_table(merged)
    for needle in (
        "tokens/s",
        "MFU",
        "jaxpi / torch",
        "per back-to-back pair",
        "fwd+bwd",
        "batch   2",
        "% of the bandwidth limit",
        "2 / 1 layers",
    ):
        assert needle in text, needle


def test_interleaved_timing_alternates_and_pairs():
    from jaxpi.bench.timing import interleaved, pair_ratios

    log = []
    fns = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    times, first = interleaved(fns, warmup=2, repeats=3, before=lambda name, i: log.append(f"{name}{i}?"))
    assert log == ["a", "a", "b", "b"] + [x for i in range(3) for x in (f"a{i}?", "a", f"b{i}?", "b")]
    assert set(times) == set(first) == {"a", "b"} and all(len(v) == 3 for v in times.values())
    assert pair_ratios([2.0, 6.0, 3.0], [1.0, 2.0, 3.0])["median"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="differ in number"):
        pair_ratios([1.0], [1.0, 2.0])


def test_bad_flags_are_refused(capsys):
    assert cli.main(["bench", "train-step", "--preset", "tiny", "--repeats", "0"]) == 2
    assert "repeats must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="comma-separated integers"):
        from jaxpi.bench.run import parse_ints

        parse_ints("8,x")


def test_gdn_inputs_are_seeded():
    from jaxpi.bench.gdn import gdn_inputs

    a, b = gdn_inputs(make_config("tiny", seq=8)), gdn_inputs(make_config("tiny", seq=8))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert np.all(a["g"] <= 0) and np.all((a["beta"] > 0) & (a["beta"] < 1))
    assert jnp.asarray(a["q"]).shape == (1, 8, 6, 16)


HLO = """
  %fusion.1 = f32[4,8]{1,0} fusion(%p0), kind=kLoop, metadata={op_name="jit(step)/jvp(layer_groups)/mlp/btd,df->btf/dot_general" stack_frame_id=1}
  %copy_fusion.2 = f32[8,4]{1,0} fusion(%p1), kind=kLoop, metadata={op_name="jit(step)/transpose(jvp(layer_groups))/mixer/delta_rule/ut_transform/dot_general"}
  ROOT %while.3 = (f32[2]) while(%t), condition=%c, body=%b, metadata={op_name="jit(step)/jvp(layer_groups)/while"}
  %ynn_fusion.4 = f32[4,16]{1,0} fusion(%p2), kind=kCustom, metadata={op_name="jit(step)/btd,dv->btv/dot_general"}
"""


def test_profile_summary_sums_op_time_by_model_part():
    from jaxpi.bench.profile import op_names, summarize

    names = op_names(HLO)
    # control flow spans its body's ops, which are traced themselves: left out, not counted twice
    assert set(names) == {"fusion.1", "copy_fusion.2", "ynn_fusion.4"}
    assert names["fusion.1"] == "fwd:/layer_groups/mlp/btd,df->btf/dot_general"
    assert names["copy_fusion.2"].startswith("bwd:/layer_groups/mixer/delta_rule/ut_transform")
    events = [
        {"name": "fusion.1", "dur": 3000.0},
        {"name": "copy_fusion.2", "dur": 1000.0},
        {"name": "copy_fusion.2", "dur": 1000.0},
        {"name": "ynn_fusion.4", "dur": 2000.0},
        {"name": "while.3", "dur": 9000.0},
        {"name": "not-an-op", "dur": 5000.0},
        # a library kernel (cuBLAS) is named after itself; the tracer names its HLO op in args
        {"name": "sm90_xmma_gemm_bf16bf16", "dur": 1000.0, "args": {"hlo_op": "fusion.1"}},
    ]
    s = summarize(events, names, steps=2)
    assert s["op_seconds_per_step"] == pytest.approx(4e-3)
    assert s["parts"]["mlp"]["s"] == pytest.approx(2e-3)
    assert s["parts"]["deltanet: (I+A)^-1 and U, W (ut_transform)"]["s"] == pytest.approx(1e-3)
    assert s["parts"]["LM head"]["share"] == pytest.approx(1 / 4)
    assert s["passes"] == pytest.approx({"fwd": 3e-3, "bwd": 1e-3})
    assert s["top_ops"][0]["op"] == "fusion.1"
    assert s["unmatched_seconds_per_step"] == pytest.approx(7e-3)
    assert s["top_unmatched"][0]["name"] == "while.3"


def test_profile_device_time_by_op_kind_and_busy_time():
    from jaxpi.bench.profile import busy_seconds, matmul_events, seconds_by_op_kind

    hlo = """
  %custom-call.7 = (bf16[8,8]{1,0}, s8[64]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
  %gemm_fusion_dot.3 = f32[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm
  %loop_add_fusion.2 = f32[8]{0} fusion(%c), kind=kLoop, calls=%add
  %copy.4 = f32[8]{0} copy(%c)
  ROOT %dot.6 = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ynn_fusion = f32[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%f, metadata={op_name="jit(f)/dot_general"}
"""
    events = [  # a kernel names its op (fusions) or carries it in args (library kernels)
        {"name": "nvjet_sm90_tst_256x128", "ts": 0.0, "dur": 4.0, "args": {"hlo_op": "custom-call.7"}},
        {"name": "gemm_fusion_dot_3", "ts": 2.0, "dur": 4.0, "args": {"hlo_op": "gemm_fusion_dot.3"}},
        {"name": "loop_add_fusion.2", "ts": 10.0, "dur": 1.0},
        {"name": "copy.4", "ts": 20.0, "dur": 1.0},
        {"name": "MemcpyD2D", "ts": 30.0, "dur": 2.0, "args": {"hlo_op": "loop_dynamic_slice_fusion.9"}},
        {"name": "x_fusion_5", "ts": 40.0, "dur": 3.0, "args": {"hlo_op": "x_fusion.5"}},
        {"name": "dot.6", "ts": 50.0, "dur": 5.0},
        {"name": "ynn_fusion", "ts": 60.0, "dur": 1.0},
    ]
    # the matmuls, whichever way they ran: a cuBLAS call, a Triton gemm fusion, a dot, a CPU
    # library fusion around a dot
    assert [e["ts"] for e in matmul_events(events, hlo)] == [0.0, 2.0, 50.0, 60.0]
    kinds = seconds_by_op_kind(events, hlo, steps=1)
    assert kinds == pytest.approx(
        {
            "cublas matmul": 4e-6,
            "triton matmul fusion": 4e-6,
            "fusion": 1e-6,
            "other": 1e-6,
            "memcpy/memset": 2e-6,
            "unknown op": 3e-6,
            "dot": 6e-6,
        }
    )
    # [0, 6) overlapping, then 1 + 1 + 2 + 3 + 5 + 1 apart: 19 µs
    assert busy_seconds(events) == pytest.approx(19e-6)
    assert busy_seconds([]) == 0.0


def test_profile_reads_only_device_events_when_a_device_was_traced(tmp_path):
    import gzip

    from jaxpi.bench.profile import trace_events

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0 (pid 2)"}},
        {"ph": "X", "pid": 1, "name": "fusion.1", "dur": 5.0},  # the host launching the kernel
        {"ph": "X", "pid": 2, "name": "fusion.1", "dur": 3.0},
        {"ph": "i", "pid": 2, "name": "marker"},
    ]
    with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    assert [e["dur"] for e in trace_events(tmp_path)] == [3.0]
    # a CPU-only trace keeps every complete event
    with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": [events[0], events[2]]}, fh)
    assert [e["dur"] for e in trace_events(tmp_path)] == [5.0]


@pytest.mark.slow
def test_profile_traces_the_real_step(capsys, tmp_path):
    rep = _run(
        capsys,
        "profile",
        "--preset",
        "tiny",
        "--seq",
        "16",
        "--steps",
        "1",
        "--trace-dir",
        str(tmp_path),
        "--json",
    )
    p = rep["results"]["profile"]
    assert p["op_seconds_per_step"] > 0 and (tmp_path / "step.hlo.txt").exists()
    # the model's scopes are found: DeltaNet, MLP and the LM head each get time
    assert {"mlp", "LM head", "deltanet: chunk scan (state carry)"} <= set(p["parts"])
    assert sum(v["share"] for v in p["parts"].values()) == pytest.approx(1.0)


def _gpu_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_gpu_bench_flags_and_flop_count(tmp_path):
    """`jaxpi bench gpu`'s flags parse to the accelerator run's defaults, and its model FLOPs are
    `jaxpi.bench.flops`' count with the DeltaNet core at chunk 64, whatever chunk the step runs."""
    args = _gpu_args("--out", str(tmp_path / "r.json"), "--gdn-chunk", "128")
    assert (args.seq, args.steps, args.rank, args.remat, args.impl) == ([8192], 5, 64, "full", ["jax"])
    assert (args.matmul_n, args.skip, args.gdn_variants, args.no_torch) == ([8192, 16384], [], None, False)
    with pytest.raises(SystemExit):
        _gpu_args("--out", "r.json", "--impl", "triton")
    cfg = TINY.replace(gdn_chunk_size=args.gdn_chunk)
    f = gpu.model_flops(cfg, 64, 1, 8)
    expected = train_step_flops(TINY.replace(gdn_chunk_size=64), seq=64, batch=1, lora_rank=8)
    assert f == {
        "frozen_matmul_params": matmul_params(TINY),
        "lora_params": lora_params(TINY, 8),
        "total": expected["total"],
    }


def _check_gdn_variants_compute_the_same_rule(variants: tuple[str, ...]) -> None:
    """The accelerator run's gated-delta variants are the same function as the plain
    sequential scan, forward and backward (so its timings compare like with like)."""
    ks = jax.random.split(jax.random.key(0), 5)
    t, h, d = 96, 2, 16
    q, k, v = (jax.random.normal(x, (1, t, h, d)) for x in ks[:3])
    g = -0.05 * jax.nn.softplus(jax.random.normal(ks[3], (1, t, h)))  # slow: the state carries
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, h)))
    args = (q, k, v, g, beta)

    def out_and_grads(spec):
        fn = gpu.gdn_variant(spec)
        grads = jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2, 3, 4))(*args)
        return fn(*args), grads

    ref_out, ref_grads = out_and_grads("jax@32")
    for spec in variants:
        out, grads = out_and_grads(spec)
        err = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out))
        assert err < 1e-5, (spec, err)
        for name, a, b in zip(["q", "k", "v", "g", "beta"], grads, ref_grads, strict=True):
            gerr = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            assert gerr < 1e-4, (spec, name, gerr)
    with pytest.raises(ValueError, match="impl must be one of"):
        gpu.gdn_variant("cuda")(*args)


def test_gpu_bench_gdn_variants_compute_the_same_rule():
    # one of each spelling (unrolled scan, Pallas kernel with precision/blocks/warps/stages);
    # the kernels themselves are held to parity in test_gated_delta.py and test_pallas_gdn.py
    _check_gdn_variants_compute_the_same_rule(("jax_unroll4@32", "pallas_split/tf32/16/4/1@32"))


@pytest.mark.slow  # every variant: ~40 s on 2 cores, most of it Pallas' interpreter
def test_gpu_bench_every_gdn_variant_computes_the_same_rule():
    _check_gdn_variants_compute_the_same_rule(
        ("jax_split2@32", "jax_assoc@32", "jax_assoc", "pallas/tf32/16/4/1@32")
    )


@pytest.mark.slow
def test_gpu_bench_runs_on_cpu(tmp_path):
    """`jaxpi bench gpu` end to end on the tiny config: matmul, gdn variants, step, profile."""
    import subprocess
    import sys

    out = tmp_path / "r.json"
    cmd = [
        sys.executable, "-m", "jaxpi.cli", "bench", "gpu",
        "--tiny", "--seq", "64", "--steps", "1", "--matmul-n", "128", "--remat", "mlp", "--no-torch",
        "--gdn-variants", "jax", "jax_split2", "pallas_split/tf32/8/4/1", "--profile", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    assert "errors" not in res, res.get("errors")
    step = res["step_seq64"]
    assert step["median_s"] > 0 and step["mfu"] > 0 and step["losses"][0] > 0
    assert {"jax_fwd", "jax_split2_fwd_bwd", "pallas_split/tf32/8/4/1_fwd_bwd"} <= set(res["gdn"])
    assert step["profile"]["op_seconds_per_step"] > 0 and res["matmul"]["peak_tflops"] > 0
    assert (tmp_path / "step_seq64_hlo.txt.gz").exists()
    # both probes ran: the chained products on the wall clock, single products by kernel time
    # (the squares and the step's MLP shape), and the peak is the larger
    kernel = res["matmul"]["kernel_timed"]
    assert set(kernel) == {"128x128x128", "64x64x128"} and all(
        v["median_tflops"] > 0 for v in kernel.values()
    )
    rates = [res["matmul"]["chained_peak_tflops"], *(v["median_tflops"] for v in kernel.values())]
    assert res["matmul"]["peak_tflops"] == max(rates)
    assert step["mfu_vs_chained"] >= step["mfu"]


def test_bench_gdn_times_the_log_depth_scan_beside_the_plain_one(capsys):
    """`jaxpi bench gdn --impl jax_assoc`: the log-depth scan's figures, the plain scan's beside
    them, their ratio and the outputs' difference (the same rule: fp32 rounding only)."""
    rep = _run(capsys, "gdn", "--preset", "tiny", "--seq", "40", "--repeats", "1", "--vs", "none",
               "--impl", "jax_assoc", "--json")  # fmt: skip
    g = rep["results"]["gdn"]
    assert g["impl"] == "jax_assoc" and g["interpreted"] is False
    for part in ("fwd", "fwd_bwd"):
        expected = g["plain_jax"][f"{part}_s"]["median"] / g["jaxpi"][f"{part}_s"]["median"]
        assert g[f"speedup_jax_assoc_{part}"] == pytest.approx(expected)
    assert g["max_abs_diff_jax_assoc_vs_plain"] < 1e-5


def test_matmul_peak_takes_the_larger_of_wall_clock_and_kernel_time():
    """`matmul_peak(kernel_timed=True)` (what an accelerator gets by default): both figures, and
    the MFU denominator is the larger median."""
    from jaxpi.bench.peak import matmul_peak

    peak = matmul_peak(96, "float32", repeats=3, kernel_timed=True)
    wall, kernel = peak["flop_per_s"]["median"], peak["kernel_timed"]["median_tflops"] * 1e12
    assert peak["mfu_peak"] == max(wall, kernel) > 0
    assert peak["mfu_peak_source"] == ("kernel" if kernel > wall else "wall")


def test_kernel_timed_matmul_rate_reads_the_matmul_kernels_of_a_trace():
    """The peak probe that times a product by its kernels under the profiler: on this CPU the
    product runs as one XLA library fusion per call, and its rate is that kernel's time alone."""
    from jaxpi.bench.peak import kernel_matmul_rate

    res = kernel_matmul_rate(96, 64, 128, dtype="float32", reps=5, warmup_s=0.1)
    # exactly the product's own kernel per call: not the host's wrapper events around it, not
    # the program's other ops
    assert res["kernels_per_call"] == 1 and len(res["kernel_names"]) == 1
    assert 0 < res["median_tflops"] <= res["max_tflops"]
