"""The 27B-shaped LoRA SFT step on one accelerator: MFU against the measured matmul peak, memory.

Random weights with the real Qwen3.5-27B shapes (64 layers, 48 DeltaNet + 16 attention), LoRA on
every linear layer, one sequence of `--seq` tokens, AdamW on the adapter. Stages run in order and
each one's result is written to `--out` as soon as it is known, so a stage that fails (out of
memory, say) still leaves the earlier figures:

    env        jax / flax versions and the device
    matmul     bf16 [n, n] @ [n, n] peak (median of 10 after 3 warm-ups) — the MFU denominator
    step       compile time, step time (median of the timed steps), tokens/s, model FLOP/s, MFU,
               peak device memory
    gdn        chunked gated delta rule, 27B layer shapes, fwd and fwd+bwd, jaxpi vs transformers'
               torch function on the same device (when torch sees the GPU); last, because torch's
               memory lies outside JAX's pool and a step after it can fail to load its kernels

Model FLOPs per step (what MFU counts; remat recomputation is not counted):
    4·P·T             frozen matmul weights P (projections + LM head): forward + input gradient
    6·P_lora·T        adapter weights: forward + input gradient + weight gradient
    3·2·T²·Hq·Dh      per attention layer (causal half of QKᵀ and PV; backward = 2× forward)
    3·2·T·H·(C(3Dk+2Dv) + 3DkDv)   per DeltaNet layer (chunk size C; the (I+A)⁻¹ not counted)

    python tools/bench_gpu_27b.py --out results.json [--seq 8192] [--steps 5] [--tiny] [--impl jax pallas]
                                  [--loss-chunk 1024]

`--impl` lists the kernel paths to measure: "jax" (plain JAX) and/or "pallas" (the Pallas gated
delta rule and norms, `gdn_impl` / `norm_impl`). The gdn stage times each path on the same inputs
and records the largest output difference from the plain path; the step stage runs once per path
(`step_seq8192`, `step_seq8192_pallas`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
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

from jaxpi.config import QWEN3_5_27B, TINY, QwenConfig
from jaxpi.kernels.gated_delta import chunk_gated_delta_rule
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
    }


def stage_matmul(sizes: list[int]) -> float:
    """The best bf16 matmul rate over `sizes` (clocks ramp up during the long warm-up)."""
    out = {}
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
        f = jax.jit(lambda a, b: a @ b)
        t = timed(lambda f=f, a=a, b=b: f(a, b), warmup=20, reps=10)
        out[str(n)] = {**stats(t), "tflops": 2.0 * n**3 / statistics.median(t) / 1e12}
    best = max(v["tflops"] for v in out.values())
    RESULTS["matmul"] = {"dtype": "bfloat16", "sizes": out, "peak_tflops": best}
    return best * 1e12


def stage_gdn(cfg: QwenConfig, seq: int, impls: list[str]) -> None:
    h, dk, dv, c = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, 64
    ks = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(ks[0], (1, seq, h, dk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, seq, h, dk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, seq, h, dv), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, seq, h), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, seq, h), jnp.float32))
    res: dict = {"shape": [1, seq, h, dk, dv], "chunk": c}
    RESULTS["gdn"] = res
    outputs = {}
    for impl in impls:
        fwd = jax.jit(lambda *a, impl=impl: chunk_gated_delta_rule(*a, chunk_size=c, impl=impl)[0])

        def loss(q, k, v, g, beta, impl=impl):
            out = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=c, impl=impl)[0]
            return jnp.sum(out.astype(jnp.float32))

        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        res[f"{impl}_fwd"] = stats(timed(lambda fwd=fwd: fwd(q, k, v, g, beta), warmup=2, reps=5))
        res[f"{impl}_fwd_bwd"] = stats(timed(lambda bwd=bwd: bwd(q, k, v, g, beta), warmup=2, reps=5))
        outputs[impl] = np.asarray(fwd(q, k, v, g, beta).astype(jnp.float32))
        save(OUT)
    if "jax" in outputs and "pallas" in outputs:
        ref = outputs["jax"]
        res["pallas_max_abs_diff_over_max_abs"] = float(
            np.abs(outputs["pallas"] - ref).max() / np.abs(ref).max()
        )
        for part in ("fwd", "fwd_bwd"):
            res[f"speedup_{part}_pallas_over_jax"] = (
                res[f"jax_{part}"]["median_s"] / res[f"pallas_{part}"]["median_s"]
            )
    if "jax" not in impls:
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


def stage_step(cfg: QwenConfig, seq: int, steps: int, rank: int, peak: float) -> None:
    res: dict = {
        "seq": seq,
        "batch": 1,
        "lora_rank": rank,
        "remat": cfg.remat,
        "layers": cfg.num_hidden_layers,
        "gdn_impl": cfg.gdn_impl,
        "norm_impl": cfg.norm_impl,
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
    ms = jax.devices()[0].memory_stats() or {}
    res["peak_bytes_in_use_gib"] = ms.get("peak_bytes_in_use", 0) / 2**30
    res["bytes_limit_gib"] = ms.get("bytes_limit", 0) / 2**30


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
    ap.add_argument("--remat", default="full")
    ap.add_argument("--matmul-n", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke run of this script)")
    ap.add_argument("--skip", nargs="*", default=[], help="stages to skip: matmul gdn step")
    ap.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        help="LM head positions per chunk in the loss (0: all at once; the whole fp32 logits are 8 GiB at 8192)",
    )
    ap.add_argument(
        "--impl", nargs="+", default=["jax"], choices=["jax", "pallas"], help="kernel paths to measure"
    )
    args = ap.parse_args()
    OUT = args.out
    cfg = (TINY if args.tiny else QWEN3_5_27B).replace(remat=args.remat)

    def kernels(impl: str) -> QwenConfig:
        return cfg.replace(gdn_impl=impl, norm_impl=impl, loss_chunk=args.loss_chunk)

    stage_env()
    save(OUT)
    peak = 0.0
    # The gdn stage runs last: its torch comparison takes GPU memory outside JAX's preallocated
    # pool, and a 27B step compiled after it could not load its kernels (CUDA out of memory with
    # remat=mlp at seq 8192, whose step needs ~117 GiB).
    stages = [("matmul", lambda: stage_matmul(args.matmul_n))]
    stages += [
        (step_name(s, impl), lambda s=s, impl=impl: stage_step(kernels(impl), s, args.steps, args.rank, peak))
        for s in args.seq
        for impl in args.impl
    ]
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
            stages += [
                (
                    step_name(s, impl),
                    lambda s=s, impl=impl, p=peak: stage_step(kernels(impl), s, args.steps, args.rank, p),
                )
                for impl in args.impl
            ]
    if "gdn" not in args.skip:
        run_stage("gdn", lambda: stage_gdn(cfg, args.seq[0], args.impl))
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
