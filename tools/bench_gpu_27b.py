"""The 27B-shaped LoRA SFT step on one accelerator: MFU against the measured matmul peak, memory.

Random weights with the real Qwen3.5-27B shapes (64 layers, 48 DeltaNet + 16 attention), LoRA on
every linear layer, one sequence of `--seq` tokens, AdamW on the adapter. Stages run in order and
each one's result is written to `--out` as soon as it is known, so a stage that fails (out of
memory, say) still leaves the earlier figures:

    env        jax / flax versions and the device
    matmul     bf16 matmul peak, the MFU denominator, the larger of: [n, n] @ [n, n] on the wall
               clock, 20 chained products per timed call (median of 10 calls after ≥ 2 s of
               warm-up); single products timed by their kernels' device time under the profiler
               (median of 10), for the squares and the step's MLP shape [seq, hidden] @ [hidden,
               intermediate]. Each step also reports its MFU against the chained figure alone.
    step       compile time, step time (median of the timed steps), tokens/s, model FLOP/s, MFU,
               peak device memory
    gdn        chunked gated delta rule, 27B layer shapes, fwd and fwd+bwd, each `--gdn-variants`
               entry, and transformers' torch function on the same device (when torch sees the
               GPU; not with `--no-torch`); last when torch runs, because torch's memory lies
               outside JAX's pool and a step after it can fail to load its kernels, else first
    torch_matmul  the same chained products in torch (cuBLAS), a cross-check (not with --no-torch)
    profile    (`--profile`) one traced step after the first step stage's timed steps: device
               time by model part (`jaxpi.bench.profile`) and by kind of op, the traced events
               and the optimized HLO beside `--out`. With CUDA graphs on (XLA's default on GPU)
               a kernel names only its graph ("command_buffer_N"), not its HLO op, so the parts
               stay unknown: profile with XLA_FLAGS=--xla_gpu_enable_command_buffer= (that run's
               step time is then without graphs: 3.946 s on the H200, against 3.853 s with
               graphs in an earlier run)

Model FLOPs per step (what MFU counts; remat recomputation is not counted):
    4·P·T             frozen matmul weights P (projections + LM head): forward + input gradient
    6·P_lora·T        adapter weights: forward + input gradient + weight gradient
    3·2·T²·Hq·Dh      per attention layer (causal half of QKᵀ and PV; backward = 2× forward)
    3·2·T·H·(C(3Dk+2Dv) + 3DkDv)   per DeltaNet layer, counted at C = 64 whatever `--gdn-chunk`
                                    the step uses (the (I+A)⁻¹ and the log-depth scan's
                                    composed maps not counted)

    python tools/bench_gpu_27b.py --out results.json [--seq 8192] [--steps 5] [--tiny] [--impl jax pallas]
                                  [--loss-chunk 1024] [--gdn-chunk 64] [--gdn-kernel block_v=16,num_stages=2]
                                  [--attn-impl pallas] [--attn-kernel block_q=32,block_k=32]
                                  [--profile] [--no-torch]
                                  [--gdn-variants jax jax_assoc jax_assoc@128 jax_unroll8]

`--impl` lists the kernel paths of the step to measure, each a `gdn_impl`: "jax" (plain JAX,
sequential chunk scan), "jax_assoc" (plain JAX, the chunks composed in log depth), "jax_split"
(plain JAX, a state-only recurrence and chunk-parallel products), "pallas" (the Pallas chunk-scan
kernels) and/or "pallas_split" (the split scan with its recurrence in Pallas); `norm_impl` =
"pallas" for the Pallas paths, else "jax" (or `--norm-impl`, for the Pallas gated delta rule with
the plain norms, say). The step stage runs once per path (`step_seq8192`, `step_seq8192_jax_assoc`,
...). The gdn stage times each `--gdn-variants` entry (default: the `--impl` paths) on the same
inputs: "impl@chunk" for another chunk size, "jax_unrollN" (the sequential scan unrolled N times),
"jax_splitN" (the split scan, its recurrence unrolled N times), "pallas/PRECISION/BLOCK_V/WARPS/STAGES"
and "pallas_split/PRECISION/BLOCK_V/WARPS/STAGES" (Pallas kernel options), and records
each one's largest output difference from plain "jax" at chunk 64 run op by op (not jitted: on
the H200 the jitted plain path itself differs from it by 2.1e-3 of max|o| with bf16 inputs and
TF32 dots).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpi.bench.peak import kernel_matmul_rate
from jaxpi.config import GDN_IMPLS, QWEN3_5_27B, REMAT_POLICIES, TINY, QwenConfig
from jaxpi.kernels.gated_delta import (
    _chunk_scan,
    chunk_gated_delta_rule,
    chunked_gated_delta_rule_with,
    linear_recurrence,
    split_chunk_scan,
)
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxpi.train.step import init_opt_state, make_train_step

RESULTS: dict = {}


def save(out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(RESULTS, indent=2, default=str))
    tmp.replace(out)


def timed(fn, *, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def stats(times: list[float]) -> dict:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "reps": len(times),
    }


def stage_env() -> None:
    import flax

    dev = jax.devices()[0]
    RESULTS["env"] = {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "device": str(dev),
        "device_kind": getattr(dev, "device_kind", "?"),
        "platform": dev.platform,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def stage_matmul(sizes: list[int], shapes: list[tuple[int, int, int]], chain: int = 20) -> float:
    """The bf16 matmul peak, two ways.

    Wall clock: each call runs `chain` dependent [n, n] @ [n, n] products in one program (so
    dispatch and the host sync are amortised), after ≥ 2 s of warm-up (the clocks ramp up from
    idle); median of 10 calls, for each n in `sizes`. Kernel time: 10 single [m, k] @ [k, n]
    products for each (m, k, n) in `shapes` (the squares and the step's MLP projection), traced
    after ≥ 2 s of warm-up; each product's rate from its own kernels' device time (the profiler's),
    median over the 10. On the H200 the step's own MLP matmuls ran at ~795 TFLOP/s in its profile
    while the chained products read 661.6 on the wall clock: a peak is the best rate the
    device shows at this dtype, so `peak_tflops` is the larger of the two (`peak_source` says which)."""
    out = {}
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        # entries N(0, 1/n): each product keeps the rows' scale, so the chain neither overflows
        # nor decays to zeros (which run faster than real data)
        b = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) * n**-0.5).astype(jnp.bfloat16)
        f = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda i, x: x @ b, a))
        jax.block_until_ready(f(a, b))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            jax.block_until_ready(f(a, b))
        t = timed(lambda f=f, a=a, b=b: f(a, b), warmup=0, reps=10)
        out[str(n)] = {**stats(t), "chain": chain, "tflops": 2.0 * n**3 * chain / statistics.median(t) / 1e12}
    kernel = {}
    for m, k, n in shapes:
        try:
            kernel[f"{m}x{k}x{n}"] = kernel_matmul_rate(m, k, n)
        except Exception as e:  # the profiler missing or failing costs this figure only
            kernel[f"{m}x{k}x{n}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    candidates = {f"chained {n}": v["tflops"] for n, v in out.items()}
    candidates |= {f"kernel {name}": v["median_tflops"] for name, v in kernel.items() if "median_tflops" in v}
    source = max(candidates, key=candidates.get)
    RESULTS["matmul"] = {
        "dtype": "bfloat16",
        "sizes": out,
        "kernel_timed": kernel,
        "chained_peak_tflops": max(v["tflops"] for v in out.values()),
        "peak_tflops": candidates[source],
        "peak_source": source,
    }
    return candidates[source] * 1e12


def stage_torch_matmul(sizes: list[int], chain: int = 20) -> None:
    """The same chained bf16 products in torch (cuBLAS), a cross-check of the JAX peak; last,
    since torch's memory lies outside JAX's pool."""
    import torch

    if not torch.cuda.is_available():
        RESULTS["torch_matmul"] = "torch sees no GPU"
        return
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, n, device="cuda") * n**-0.5).to(torch.bfloat16)

        def f(a=a, b=b):
            x = a
            for _ in range(chain):
                x = x @ b
            return x

        f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            f()
            torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        out[str(n)] = {
            **stats(times),
            "chain": chain,
            "tflops": 2.0 * n**3 * chain / statistics.median(times) / 1e12,
        }
    RESULTS["torch_matmul"] = {"torch": torch.__version__, "sizes": out}


def time_gdn_variant(spec: str, res: dict, ref: np.ndarray, args: tuple) -> None:
    """fwd and fwd+bwd medians of one gdn stage entry, and its output's largest difference from `ref`."""
    fn = gdn_variant(spec)
    fwd = jax.jit(fn)

    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32))

    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    res[f"{spec}_fwd"] = stats(timed(lambda: fwd(*args), warmup=2, reps=5))
    res[f"{spec}_fwd_bwd"] = stats(timed(lambda: bwd(*args), warmup=2, reps=5))
    out = np.asarray(fwd(*args).astype(jnp.float32))
    res[f"{spec}_max_abs_diff_over_max_abs"] = float(np.abs(out - ref).max() / np.abs(ref).max())
    for part in ("fwd", "fwd_bwd"):
        if "jax_fwd" in res and spec != "jax":
            res[f"speedup_{part}_{spec}_over_jax"] = (
                res[f"jax_{part}"]["median_s"] / res[f"{spec}_{part}"]["median_s"]
            )


def gdn_variant(spec: str) -> Callable[..., jax.Array]:
    """A gdn stage entry -> fn(q, k, v, g, beta) -> output. Entries: "impl",
    "impl@chunk", "jax_unrollN" (the sequential scan unrolled N times), "jax_splitN"
    (`split_chunk_scan` with its plain-JAX recurrence unrolled N times) and
    "pallas/PRECISION/BLOCK_V/WARPS/STAGES" or "pallas_split/..." (kernel options)."""
    name, _, chunk = spec.partition("@")
    c = int(chunk or 64)
    if name.startswith(("pallas/", "pallas_split/")):
        from jaxpi.kernels.pallas import pallas_chunk_gated_delta_rule

        kind, precision, block_v, warps, stages = name.split("/")
        kw = dict(precision=precision, block_v=int(block_v), num_warps=int(warps), num_stages=int(stages))
        kw["split"] = kind == "pallas_split"
        return lambda q, k, v, g, beta: pallas_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=c, **kw)[0]
    if name.startswith(("jax_unroll", "jax_split")) and name not in GDN_IMPLS:
        unroll = int(name.removeprefix("jax_unroll").removeprefix("jax_split"))
        if name.startswith("jax_split"):
            scan = split_chunk_scan(functools.partial(linear_recurrence, unroll=unroll))
        else:
            scan = functools.partial(_chunk_scan, unroll=unroll)

        def fn(q, k, v, g, beta):
            kw = dict(chunk_size=c, initial_state=None, segment_ids=None, use_qk_l2norm=True)
            return chunked_gated_delta_rule_with(scan, q, k, v, g, beta, **kw)[0]

        return fn
    return lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=c, impl=name)[0]


def stage_gdn(cfg: QwenConfig, seq: int, variants: list[str], torch_too: bool) -> None:
    h, dk, dv, c = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, 64
    ks = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(ks[0], (1, seq, h, dk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, seq, h, dk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, seq, h, dv), jnp.bfloat16)
    # slow decays (mean g ≈ −0.04 per token): the state carries across many chunks, so the output
    # differences below exercise the chunk recurrence (fast decays would hide a wrong carry)
    g = -0.05 * jax.nn.softplus(jax.random.normal(ks[3], (1, seq, h), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, seq, h), jnp.float32))
    res: dict = {"shape": [1, seq, h, dk, dv], "chunk": c}
    RESULTS["gdn"] = res
    ref = np.asarray(gdn_variant("jax")(q, k, v, g, beta).astype(jnp.float32))
    for spec in variants:
        try:
            time_gdn_variant(spec, res, ref, (q, k, v, g, beta))
        except Exception as e:  # a variant that fails to compile (shared memory, say) is a result too
            res[f"{spec}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        save(OUT)
    if not torch_too or "jax" not in variants:
        return
    try:
        import torch

        if not torch.cuda.is_available():
            res["torch"] = "torch sees no GPU"
            return
        try:
            from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as tf
        except ImportError:
            from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as tf
        import transformers

        res["transformers"] = transformers.__version__
        tt = [torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda() for x in (q, k, v, g, beta)]
        tq, tk, tv = (x.to(torch.bfloat16) for x in tt[:3])
        tg, tb = tt[3], tt[4]

        def t_fwd():
            return tf(tq, tk, tv, tg, tb, chunk_size=c, use_qk_l2norm_in_kernel=True)[0]

        def t_time(fn, warmup=2, reps=5):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                out.append(time.perf_counter() - t0)
            return out

        res["torch_fwd"] = stats(t_time(t_fwd))
        leaves = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv, tg, tb)]

        def t_bwd():
            o = tf(*leaves, chunk_size=c, use_qk_l2norm_in_kernel=True)[0]
            o.float().sum().backward()

        res["torch_fwd_bwd"] = stats(t_time(t_bwd))
        res["ratio_fwd_torch_over_jax"] = res["torch_fwd"]["median_s"] / res["jax_fwd"]["median_s"]
        res["ratio_fwd_bwd_torch_over_jax"] = (
            res["torch_fwd_bwd"]["median_s"] / res["jax_fwd_bwd"]["median_s"]
        )
    except Exception as e:  # torch on this device is a bonus, not the point
        res["torch"] = f"{type(e).__name__}: {e}"


def model_flops(cfg: QwenConfig, state: nnx.State, seq: int, batch: int) -> dict:
    frozen = lora = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        n = int(np.prod(leaf.shape))
        if "lora" in name:
            lora += n
        elif leaf.ndim >= 2 and name != "embed" and "conv" not in name:
            frozen += n
    t = seq * batch
    n_attn = sum(1 for x in cfg.layer_types if x == "full_attention")
    n_gdn = cfg.num_hidden_layers - n_attn
    c, dk, dv, h = 64, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    attn = 3 * 2 * seq * seq * cfg.num_attention_heads * cfg.head_dim * batch
    gdn = 3 * 2 * t * h * (c * (3 * dk + 2 * dv) + 3 * dk * dv)
    total = 4 * frozen * t + 6 * lora * t + n_attn * attn + n_gdn * gdn
    return {"frozen_matmul_params": frozen, "lora_params": lora, "total": float(total)}


def stage_step(cfg: QwenConfig, seq: int, steps: int, rank: int, peak: float, profile: bool) -> None:
    res: dict = {
        "seq": seq,
        "batch": 1,
        "lora_rank": rank,
        "remat": cfg.remat,
        "layers": cfg.num_hidden_layers,
        "gdn_impl": cfg.gdn_impl,
        "gdn_kernel": cfg.gdn_kernel,
        "gdn_chunk_size": cfg.gdn_chunk_size,
        "norm_impl": cfg.norm_impl,
        "attn_impl": cfg.attn_impl,
        "attn_kernel": cfg.attn_kernel,
        "loss_chunk": cfg.loss_chunk,
    }
    RESULTS[step_name(seq, cfg.gdn_impl)] = res

    def build() -> Qwen3_5ForCausalLM:
        m = Qwen3_5ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        add_lora(m, LoraConfig(rank=rank, alpha=2.0 * rank))
        return m

    t0 = time.perf_counter()
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    leaves, treedef = jax.tree.flatten(abstract)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def fill(key, shape, dtype):
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    arrays = [fill(jax.random.key(i), tuple(x.shape), jnp.dtype(x.dtype)) for i, x in enumerate(leaves)]
    state = jax.tree.unflatten(treedef, arrays)
    jax.block_until_ready(state)
    res["init_s"] = time.perf_counter() - t0
    res["flops"] = model_flops(cfg, state, seq, 1)

    optimizer = optax.adamw(1e-5)
    opt_state = jax.jit(lambda p: init_opt_state(optimizer, p, trainable=LoRAParam))(state)
    step = jax.jit(make_train_step(graphdef, optimizer, trainable=LoRAParam), donate_argnums=(0, 1))
    batch = {"input_ids": jax.random.randint(jax.random.key(9), (1, seq), 0, cfg.vocab_size, jnp.int32)}
    t0 = time.perf_counter()
    compiled = step.lower(state, opt_state, batch).compile()
    res["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is not None:
        res["compiled_temp_gib"] = mem.temp_size_in_bytes / 2**30
        res["compiled_argument_gib"] = mem.argument_size_in_bytes / 2**30
    save(OUT)

    times, losses = [], []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        state, opt_state, metrics = compiled(state, opt_state, batch)
        loss = float(metrics["loss"])
        if i >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    res.update(stats(times))
    res["losses"] = losses
    res["tokens_per_s"] = seq / res["median_s"]
    res["model_tflops_per_s"] = res["flops"]["total"] / res["median_s"] / 1e12
    if peak:
        res["mfu"] = res["flops"]["total"] / res["median_s"] / peak
        chained = RESULTS.get("matmul", {}).get("chained_peak_tflops")
        if chained:  # against the wall-clock chained products alone (the denominator until 2026-11-30)
            res["mfu_vs_chained"] = res["flops"]["total"] / res["median_s"] / (chained * 1e12)
    ms = jax.devices()[0].memory_stats() or {}
    res["peak_bytes_in_use_gib"] = ms.get("peak_bytes_in_use", 0) / 2**30
    res["bytes_limit_gib"] = ms.get("bytes_limit", 0) / 2**30
    save(OUT)
    if profile:
        res["profile"] = profile_step(compiled, state, opt_state, batch, step_name(seq, cfg.gdn_impl))


def profile_step(compiled, state, opt_state, batch, name: str) -> dict:
    """Trace one step; device time by model part, and the trace beside `--out` (≤ 15 MB gzipped)."""
    from jaxpi.bench.profile import busy_seconds, op_names, seconds_by_op_kind, summarize, trace_events

    trace_dir = Path(tempfile.mkdtemp(prefix="jaxpi-trace-"))
    t0 = time.perf_counter()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        state, opt_state, metrics = compiled(state, opt_state, batch)
        jax.block_until_ready(metrics)
    traced_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    events = trace_events(trace_dir)
    out = summarize(events, op_names(hlo), steps=1)
    out["traced_step_wall_s"] = traced_s
    # the device's busy time against the traced wall time: the rest is the GPU waiting on the host
    out["device_busy_s"] = busy_seconds(events)
    out["kernels"] = len(events)
    out["kinds"] = seconds_by_op_kind(events, hlo)
    per_kernel: dict = {}
    for e in events:
        per_kernel[e["name"]] = per_kernel.get(e["name"], 0.0) + e["dur"] * 1e-6
    out["top_kernels"] = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:40]
    for f in trace_dir.rglob("perfetto_trace.json.gz"):
        if f.stat().st_size < 15e6:
            shutil.copy(f, OUT.parent / f"{name}_trace.json.gz")
    # the traced events alone, [name, start µs, duration µs, HLO op] (a 27B step's whole trace is
    # larger than a device machine returns; this list was 2.8 MB gzipped for 310k kernels)
    slim = [[e["name"], e.get("ts"), e["dur"], e.get("args", {}).get("hlo_op", "")] for e in events]
    with gzip.open(OUT.parent / f"{name}_events.json.gz", "wt") as fh:
        json.dump(slim, fh)
    with gzip.open(OUT.parent / f"{name}_hlo.txt.gz", "wt") as fh:
        fh.write(hlo)
    return out


def step_name(seq: int, impl: str) -> str:
    return f"step_seq{seq}" + ("" if impl == "jax" else f"_{impl}")


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq", type=int, nargs="+", default=[8192])
    ap.add_argument("--fallback-seq", type=int, default=None, help="run this length if the first fails")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--remat", choices=list(REMAT_POLICIES), default="full", help="the step's remat policy")
    ap.add_argument("--matmul-n", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke run of this script)")
    ap.add_argument("--skip", nargs="*", default=[], help="stages to skip: matmul gdn step torch")
    ap.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        help="LM head positions per chunk in the loss (0: all at once; the whole fp32 logits are 8 GiB at 8192)",
    )
    ap.add_argument(
        "--impl",
        nargs="+",
        default=["jax"],
        choices=list(GDN_IMPLS),
        help="the step's gdn_impl, one step stage per entry",
    )
    ap.add_argument("--gdn-chunk", type=int, default=64, help="the step's gdn_chunk_size")
    ap.add_argument(
        "--attn-impl",
        choices=["jax", "pallas"],
        default="jax",
        help="the step's attn_impl: the blocked plain-JAX causal attention or flash attention (Pallas/Triton)",
    )
    ap.add_argument(
        "--attn-kernel",
        default="",
        help='the flash attention\'s attn_kernel with --attn-impl pallas, e.g. "block_q=32,block_k=32,block_backward=16"',
    )
    ap.add_argument(
        "--gdn-kernel",
        default="",
        help="the Pallas step paths' gdn_kernel, e.g. \"block_v=16,num_stages=2\" (default: the kernels' defaults)",
    )
    ap.add_argument(
        "--norm-impl",
        choices=["jax", "pallas"],
        default=None,
        help="the step's norm_impl (default: pallas for --impl pallas / pallas_split, else jax)",
    )
    ap.add_argument(
        "--gdn-variants",
        nargs="+",
        default=None,
        help='gdn stage entries: "impl", "impl@chunk", "jax_unrollN", "jax_splitN", "pallas/PREC/BV/WARPS/STAGES",'
        ' "pallas_split/PREC/BV/WARPS/STAGES"'
        " (default: the --impl paths)",
    )
    ap.add_argument("--no-torch", action="store_true", help="no transformers comparison in the gdn stage")
    ap.add_argument("--profile", action="store_true", help="trace one step of the first step stage")
    args = ap.parse_args()
    OUT = args.out
    OUT.parent.mkdir(parents=True, exist_ok=True)
    cfg = (TINY if args.tiny else QWEN3_5_27B).replace(remat=args.remat)

    def kernels(impl: str) -> QwenConfig:
        pallas = impl.startswith("pallas")
        norm = args.norm_impl or ("pallas" if pallas else "jax")
        return cfg.replace(
            gdn_impl=impl,
            gdn_kernel=args.gdn_kernel if pallas else "",
            norm_impl=norm,
            attn_impl=args.attn_impl,
            attn_kernel=args.attn_kernel if args.attn_impl == "pallas" else "",
            loss_chunk=args.loss_chunk,
            gdn_chunk_size=args.gdn_chunk,
        )

    stage_env()
    save(OUT)
    peak = 0.0
    variants = args.gdn_variants or args.impl
    gdn_stage = ("gdn", lambda: stage_gdn(cfg, args.seq[0], variants, not args.no_torch))
    # With torch, the gdn stage runs last: torch takes GPU memory outside JAX's preallocated
    # pool, and a 27B step compiled after it could not load its kernels (CUDA out of memory with
    # remat=mlp at seq 8192, whose step needs ~117 GiB). Without torch it runs first (cheap).
    # the kernel-timed probe: the squares, and the step's widest projection at its first length
    shapes = [(n, n, n) for n in args.matmul_n] + [(args.seq[0], cfg.hidden_size, cfg.intermediate_size)]
    stages = [("matmul", lambda: stage_matmul(args.matmul_n, shapes))]
    if args.no_torch:
        stages.append(gdn_stage)

    def step_stage(s: int, impl: str, first: bool):
        return lambda: stage_step(kernels(impl), s, args.steps, args.rank, peak, args.profile and first)

    stages += [
        (step_name(s, impl), step_stage(s, impl, i == 0))
        for i, (s, impl) in enumerate((s, impl) for s in args.seq for impl in args.impl)
    ]
    if not args.no_torch:
        stages.append(gdn_stage)
        stages.append(("torch_matmul", lambda: stage_torch_matmul(args.matmul_n)))
    i = 0
    while i < len(stages):  # a failed first step length appends the fallback length's steps
        name, fn = stages[i]
        i += 1
        if name.split("_")[0] in args.skip:
            continue
        result = run_stage(name, fn)
        if name == "matmul" and result is not None:
            peak = result
        if name.startswith("step_") and name in RESULTS.get("errors", {}) and args.fallback_seq:
            s, args.fallback_seq = args.fallback_seq, None
            stages[i:i] = [(step_name(s, impl), step_stage(s, impl, False)) for impl in args.impl]
    return 0


def run_stage(name: str, fn: Callable[[], Any]) -> Any:
    """Run one stage; its figures (or its error) reach the results file either way."""
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    out = None
    try:
        out = fn()
    except Exception as e:
        RESULTS.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:2000]}"
        traceback.print_exc()
    RESULTS.setdefault("stage_seconds", {})[name] = time.perf_counter() - t0
    save(OUT)
    print(json.dumps({k: v for k, v in RESULTS.items() if k != "env"}, default=str)[:3000], flush=True)
    return out


OUT = Path("results.json")
if __name__ == "__main__":
    sys.exit(main())
