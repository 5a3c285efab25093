"""The jaxpi LoRA SFT step, timed: tokens/s, model FLOP/s and MFU.

The step is the one `jaxpi sft` runs (`jaxpi.train.step.make_train_step`, LoRA on every linear
layer, AdamW on the adapter, next-token loss over all positions), loaded from a HF checkpoint on
disk with `load_hf`, jitted with the parameters and optimizer state donated, and called on the
same token batch every repeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpi.bench.config import BenchConfig
from jaxpi.bench.flops import train_step_flops
from jaxpi.bench.timing import figure, rate, timed

LR = 1e-4  # the same in the torch step; the value only matters for not diverging


def bench_tokens(bench: BenchConfig) -> np.ndarray:
    """The token batch `[batch, seq]` both frameworks train on (seeded)."""
    rng = np.random.default_rng(bench.seed)
    return rng.integers(0, bench.model.vocab_size, (bench.batch, bench.seq), dtype=np.int64)


def write_checkpoint(bench: BenchConfig, out_dir: str | Path) -> Path:
    """A random HF checkpoint of the bench model, written by `transformers` (fp32 on disk; each
    framework loads it in the bench dtype)."""
    import transformers

    from jaxpi.hf_fixtures import make_checkpoint

    transformers.utils.logging.disable_progress_bar()
    return make_checkpoint(out_dir, bench.model, seed=bench.seed, dtype="float32")


def build_jaxpi_step(bench: BenchConfig, ckpt: str | Path, ids: np.ndarray) -> dict[str, Any]:
    """Load `ckpt`, attach adapters and compile the step: {"step" (compiled), "params",
    "opt_state", "batch", "load_s", "compile_s"}. The step donates params and optimizer state."""
    from jaxpi.convert.hf import load_hf
    from jaxpi.lora import LoraConfig, LoRAParam, add_lora
    from jaxpi.train.step import init_opt_state, make_train_step

    m = bench.model
    t0 = time.perf_counter()
    _, model = load_hf(
        ckpt,
        bench.dtype,
        config_overrides={
            "remat": m.remat,
            "gdn_chunk_size": m.gdn_chunk_size,
            "gdn_impl": m.gdn_impl,
            "norm_impl": m.norm_impl,
        },
    )
    add_lora(model, LoraConfig(rank=bench.lora_rank, alpha=2.0 * bench.lora_rank), key=jax.random.key(1))
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(LR)
    opt_state = init_opt_state(optimizer, params, trainable=LoRAParam)
    batch = {"input_ids": jnp.asarray(ids, jnp.int32)}
    load_s = time.perf_counter() - t0

    step = jax.jit(make_train_step(graphdef, optimizer, trainable=LoRAParam), donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    return {
        "step": compiled,
        "params": params,
        "opt_state": opt_state,
        "batch": batch,
        "load_s": load_s,
        "compile_s": compile_s,
        # XLA's own count: every op, but a scanned loop body once (not per layer group)
        "xla_flops": float(cost.get("flops", 0.0)),
    }


def jaxpi_step_runner(
    bench: BenchConfig, ckpt: str | Path, ids: np.ndarray
) -> tuple[Callable[[], jax.Array], dict[str, Any]]:
    """(one call of the built step on the carried params and optimizer state, its build info with
    "losses": every call's loss, appended as it runs)."""
    built = build_jaxpi_step(bench, ckpt, ids)
    compiled, batch = built["step"], built["batch"]
    carry = [built.pop("params"), built.pop("opt_state")]
    losses: list[jax.Array] = []
    built["losses"] = losses

    def call() -> jax.Array:
        carry[0], carry[1], metrics = compiled(carry[0], carry[1], batch)
        losses.append(metrics["loss"])
        return metrics["loss"]

    return call, built


def jaxpi_figures(
    bench: BenchConfig,
    times: list[float],
    first_s: float,
    built: dict[str, Any],
    peak: float,
    adjacent_peaks: list[float] | None = None,
) -> dict[str, Any]:
    """The jaxpi report from the timed repeats. `peak`: the run's matmul FLOP/s for `mfu`;
    `adjacent_peaks` (one per repeat, measured right before it) add `peak_adjacent` and
    `mfu_adjacent`, each repeat's MFU against the peak of its own moment. The adjacent probes are
    timed on the wall clock (`peak_adjacent_source`), also where `peak` is kernel-timed."""
    flops = train_step_flops(bench.model, seq=bench.seq, batch=bench.batch, lora_rank=bench.lora_rank)
    losses = built["losses"]
    out = {
        "step_s": figure(times),
        "tokens_per_s": rate(bench.tokens, times),
        "flop_per_s": rate(flops["total"], times),
        "mfu": figure([flops["total"] / t / peak for t in times]),
        "compile_s": built["compile_s"],
        "xla_flops_per_step": built["xla_flops"],
        "first_call_s": first_s,
        "load_s": built["load_s"],
        "loss_first": float(losses[0]),
        "loss_last": float(losses[-1]),
    }
    if adjacent_peaks is not None:
        out["peak_adjacent"] = figure(adjacent_peaks)
        out["peak_adjacent_source"] = "wall"
        out["mfu_adjacent"] = figure(
            [flops["total"] / t / p for t, p in zip(times, adjacent_peaks, strict=True)]
        )
    return out


def jaxpi_train_step(bench: BenchConfig, ckpt: str | Path, ids: np.ndarray, peak: float) -> dict[str, Any]:
    """Build the step (`build_jaxpi_step`) and time it alone. `peak`: matmul FLOP/s for MFU."""
    call, built = jaxpi_step_runner(bench, ckpt, ids)
    times, first_s = timed(call, warmup=bench.warmup, repeats=bench.repeats)
    return jaxpi_figures(bench, times, first_s, built, peak)
