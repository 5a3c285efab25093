"""Compile time of the LoRA train step against depth: scanned layer groups keep it flat.

Nothing is allocated: the model, its adapters and the optimizer state are abstract
(`nnx.eval_shape`), and each timed repeat traces, lowers and compiles a fresh `jax.jit` of the
step (what a user waits for on a cold start: no compilation cache, in memory or on disk). One
untimed compile of the first depth warms up the backend.

Repeats visit the depths in turn (8, 16, 64, 8, 16, 64, ...) so that a load change on a shared
machine falls on every depth alike, and each compile also reports the process's CPU seconds:
XLA's CPU compiler is busy the whole time, so CPU time tracks the compiler's work where wall time
also counts waiting for other processes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpi import compile_cache
from jaxpi.bench.config import BenchConfig
from jaxpi.bench.timing import figure


def abstract_step(bench: BenchConfig, layers: int | None = None) -> tuple[Any, tuple]:
    """(the un-jitted step, abstract (params, opt_state, batch)) for the bench model, at `layers`
    depth (the layer pattern re-derived) or as it is (None)."""
    from jaxpi.lora import LoraConfig, LoRAParam, add_lora
    from jaxpi.models.families import model_class
    from jaxpi.train.step import init_opt_state, make_train_step

    cfg = bench.model if layers is None else bench.model.replace(num_hidden_layers=layers)
    dtype = jnp.dtype(bench.dtype)
    rank = bench.lora_rank

    def build() -> Any:
        model = model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        return add_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank))

    graphdef, params = nnx.split(nnx.eval_shape(build))
    optimizer = optax.adamw(1e-4)
    opt_state = jax.eval_shape(lambda p: init_opt_state(optimizer, p, trainable=LoRAParam), params)
    batch = {"input_ids": jax.ShapeDtypeStruct((bench.batch, bench.seq), jnp.int32)}
    step = make_train_step(graphdef, optimizer, trainable=LoRAParam)
    return step, (params, opt_state, batch)


def compile_once(step: Any, args: tuple) -> tuple[float, float, float]:
    """(trace + lower seconds, compile seconds, CPU seconds of both) of a fresh jit of `step`."""
    fresh = jax.jit(lambda p, o, b: step(p, o, b), donate_argnums=(0, 1))
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = fresh.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1, time.process_time() - c0


def compile_bench(bench: BenchConfig, layers: Sequence[int] = (8, 16, 64)) -> dict[str, Any]:
    """Per depth: trace+lower, compile, total and CPU seconds (figures); the deepest depth's
    median total (and CPU) seconds over the shallowest's."""
    if not layers or min(layers) < 1:
        raise ValueError(f"compile needs layer counts >= 1, got {list(layers)}")
    depths = sorted(set(layers))
    steps = {n: abstract_step(bench, n) for n in depths}
    with compile_cache.disabled():  # a persistent cache would time loads, not compiles
        times = _timed_compiles(bench, depths, steps)
    out: dict[str, Any] = {"layers": {}}
    for n in depths:
        lower, comp, cpu = (list(col) for col in zip(*times[n], strict=True))
        out["layers"][str(n)] = {
            "lower_s": figure(lower),
            "compile_s": figure(comp),
            "total_s": figure([a + b for a, b in zip(lower, comp, strict=True)]),
            "cpu_s": figure(cpu),
        }
    lo, hi = out["layers"][str(depths[0])], out["layers"][str(depths[-1])]
    out["ratio_deepest_over_shallowest"] = hi["total_s"]["median"] / lo["total_s"]["median"]
    out["ratio_cpu_deepest_over_shallowest"] = hi["cpu_s"]["median"] / lo["cpu_s"]["median"]
    out["deepest"], out["shallowest"] = depths[-1], depths[0]
    return out


def _timed_compiles(bench: BenchConfig, depths: list[int], steps: dict) -> dict[int, list]:
    for _ in range(bench.warmup):
        compile_once(*steps[depths[0]])
        jax.clear_caches()
    times: dict[int, list[tuple[float, float, float]]] = {n: [] for n in depths}
    for _ in range(bench.repeats):
        for n in depths:
            times[n].append(compile_once(*steps[n]))
            jax.clear_caches()  # the next compile starts cold, as a new process would
    return times
