"""`jaxpi bench gpu`: the 27B-shaped LoRA step on one accelerator, stage by stage.

What each stage measures, the FLOP count and the flags: `jaxpi.bench.gpu_flags`. Timing is
`jaxpi.bench.timing`'s, the model FLOPs `jaxpi.bench.flops`' and the kernel-timed matmul rate
`jaxpi.bench.peak`'s; the results file is rewritten (atomically) after every stage.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpi.atomic import write_text
from jaxpi.bench.flops import train_step_flops
from jaxpi.bench.peak import kernel_matmul_rate
from jaxpi.bench.profile import busy_seconds, op_names, seconds_by_op_kind, summarize, trace_events
from jaxpi.bench.timing import figure, timed
from jaxpi.config import GDN_IMPLS, QWEN3_5_27B, TINY, QwenConfig
from jaxpi.kernels.gated_delta import chunk_gated_delta_rule
from jaxpi.kernels.gdn_chunked import (
    _chunk_scan,
    chunked_gated_delta_rule_with,
    linear_recurrence,
    split_chunk_scan,
)
from jaxpi.kernels.pallas import pallas_chunk_gated_delta_rule
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxpi.train.step import init_opt_state, make_train_step

# The chunk at which the DeltaNet FLOPs are counted, whatever chunk the step runs.
FLOP_CHUNK = 64


class Results:
    """The results file's object, written to `out` as a whole after every change worth keeping."""

    def __init__(self, out: Path) -> None:
        self.out, self.data = out, {}

    def save(self) -> None:
        write_text(self.out, json.dumps(self.data, indent=2, default=str))


def stats(times: list[float]) -> dict[str, Any]:
    """{"median_s", "min_s", "max_s", "reps"} of per-call seconds."""
    f = figure(times)
    return {"median_s": f["median"], "min_s": f["min"], "max_s": f["max"], "reps": f["repeats"]}


def time_calls(fn: Callable[[], Any], *, warmup: int, reps: int) -> list[float]:
    return timed(fn, warmup=warmup, repeats=reps)[0]


def stage_env(res: Results) -> None:
    dev = jax.devices()[0]
    res.data["env"] = {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "device": str(dev),
        "device_kind": getattr(dev, "device_kind", "?"),
        "platform": dev.platform,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def stage_matmul(
    res: Results, sizes: list[int], shapes: list[tuple[int, int, int]], chain: int = 20
) -> float:
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
        t = time_calls(lambda f=f, a=a, b=b: f(a, b), warmup=0, reps=10)
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
    res.data["matmul"] = {
        "dtype": "bfloat16",
        "sizes": out,
        "kernel_timed": kernel,
        "chained_peak_tflops": max(v["tflops"] for v in out.values()),
        "peak_tflops": candidates[source],
        "peak_source": source,
    }
    return candidates[source] * 1e12


def stage_torch_matmul(res: Results, sizes: list[int], chain: int = 20) -> None:
    """The same chained bf16 products in torch (cuBLAS), a cross-check of the JAX peak; last,
    since torch's memory lies outside JAX's pool."""
    import torch

    if not torch.cuda.is_available():
        res.data["torch_matmul"] = "torch sees no GPU"
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
    res.data["torch_matmul"] = {"torch": torch.__version__, "sizes": out}


def time_gdn_variant(spec: str, res: dict, ref: np.ndarray, args: tuple) -> None:
    """fwd and fwd+bwd medians of one gdn stage entry, and its output's largest difference from `ref`."""
    fn = gdn_variant(spec)
    fwd = jax.jit(fn)

    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32))

    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    res[f"{spec}_fwd"] = stats(time_calls(lambda: fwd(*args), warmup=2, reps=5))
    res[f"{spec}_fwd_bwd"] = stats(time_calls(lambda: bwd(*args), warmup=2, reps=5))
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


def stage_gdn(results: Results, cfg: QwenConfig, seq: int, variants: list[str], torch_too: bool) -> None:
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
    results.data["gdn"] = res
    ref = np.asarray(gdn_variant("jax")(q, k, v, g, beta).astype(jnp.float32))
    for spec in variants:
        try:
            time_gdn_variant(spec, res, ref, (q, k, v, g, beta))
        except Exception as e:  # a variant that fails to compile (shared memory, say) is a result too
            res[f"{spec}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        results.save()
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


def model_flops(cfg: QwenConfig, seq: int, batch: int, rank: int) -> dict[str, Any]:
    """The step's model FLOPs (`jaxpi.bench.flops`), the DeltaNet core counted at `FLOP_CHUNK`."""
    f = train_step_flops(cfg.replace(gdn_chunk_size=FLOP_CHUNK), seq=seq, batch=batch, lora_rank=rank)
    return {"frozen_matmul_params": f["matmul_params"], "lora_params": f["lora_params"], "total": f["total"]}


def stage_step(
    results: Results, cfg: QwenConfig, seq: int, steps: int, rank: int, peak: float, profile: bool
) -> None:
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
    results.data[step_name(seq, cfg.gdn_impl)] = res

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
    res["flops"] = model_flops(cfg, seq, 1, rank)

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
    results.save()

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
        chained = results.data.get("matmul", {}).get("chained_peak_tflops")
        if chained:  # against the wall-clock chained products alone (the denominator until 2026-11-30)
            res["mfu_vs_chained"] = res["flops"]["total"] / res["median_s"] / (chained * 1e12)
    ms = jax.devices()[0].memory_stats() or {}
    res["peak_bytes_in_use_gib"] = ms.get("peak_bytes_in_use", 0) / 2**30
    res["bytes_limit_gib"] = ms.get("bytes_limit", 0) / 2**30
    results.save()
    if profile:
        name = step_name(seq, cfg.gdn_impl)
        res["profile"] = profile_step(compiled, state, opt_state, batch, results.out.parent, name)


def profile_step(
    compiled: Any, state: Any, opt_state: Any, batch: dict, where: Path, name: str
) -> dict[str, Any]:
    """Trace one step; device time by model part, and the trace in `where` (≤ 15 MB gzipped)."""
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
            shutil.copy(f, where / f"{name}_trace.json.gz")
    # the traced events alone, [name, start µs, duration µs, HLO op] (a 27B step's whole trace is
    # larger than a device machine returns; this list was 2.8 MB gzipped for 310k kernels)
    slim = [[e["name"], e.get("ts"), e["dur"], e.get("args", {}).get("hlo_op", "")] for e in events]
    with gzip.open(where / f"{name}_events.json.gz", "wt") as fh:
        json.dump(slim, fh)
    with gzip.open(where / f"{name}_hlo.txt.gz", "wt") as fh:
        fh.write(hlo)
    return out


def step_name(seq: int, impl: str) -> str:
    return f"step_seq{seq}" + ("" if impl == "jax" else f"_{impl}")


def run(args: argparse.Namespace) -> int:
    """Run the stages `jaxpi.bench.gpu_flags.add_arguments`' flags ask for; 0 (a failed stage is
    recorded under "errors" in the results file, not an exit status)."""
    # JAX may take 95 % of the device's memory (the default 75 % is short for the 27B step); read
    # when the backend starts, so before the first device call of this process
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    results = Results(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
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

    stage_env(results)
    results.save()
    peak = 0.0
    variants = args.gdn_variants or args.impl
    gdn_stage = ("gdn", lambda: stage_gdn(results, cfg, args.seq[0], variants, not args.no_torch))
    # With torch, the gdn stage runs last: torch takes GPU memory outside JAX's preallocated
    # pool, and a 27B step compiled after it could not load its kernels (CUDA out of memory with
    # remat=mlp at seq 8192, whose step needs ~117 GiB). Without torch it runs first (cheap).
    # the kernel-timed probe: the squares, and the step's widest projection at its first length
    shapes = [(n, n, n) for n in args.matmul_n] + [(args.seq[0], cfg.hidden_size, cfg.intermediate_size)]
    stages = [("matmul", lambda: stage_matmul(results, args.matmul_n, shapes))]
    if args.no_torch:
        stages.append(gdn_stage)

    def step_stage(s: int, impl: str, first: bool):
        return lambda: stage_step(
            results, kernels(impl), s, args.steps, args.rank, peak, args.profile and first
        )

    stages += [
        (step_name(s, impl), step_stage(s, impl, i == 0))
        for i, (s, impl) in enumerate((s, impl) for s in args.seq for impl in args.impl)
    ]
    if not args.no_torch:
        stages.append(gdn_stage)
        stages.append(("torch_matmul", lambda: stage_torch_matmul(results, args.matmul_n)))
    fallback = args.fallback_seq
    i = 0
    while i < len(stages):  # a failed first step length appends the fallback length's steps
        name, fn = stages[i]
        i += 1
        if name.split("_")[0] in args.skip:
            continue
        result = run_stage(results, name, fn)
        if name == "matmul" and result is not None:
            peak = result
        if name.startswith("step_") and name in results.data.get("errors", {}) and fallback:
            s, fallback = fallback, None
            stages[i:i] = [(step_name(s, impl), step_stage(s, impl, False)) for impl in args.impl]
    return 0


def run_stage(results: Results, name: str, fn: Callable[[], Any]) -> Any:
    """Run one stage; its figures (or its error) reach the results file either way."""
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    out = None
    try:
        out = fn()
    except Exception as e:
        results.data.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:2000]}"
        traceback.print_exc()
    results.data.setdefault("stage_seconds", {})[name] = time.perf_counter() - t0
    results.save()
    print(json.dumps({k: v for k, v in results.data.items() if k != "env"}, default=str)[:3000], flush=True)
    return out
