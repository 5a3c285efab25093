"""The matmul peak of this device, measured: the MFU denominator.

A square `jnp.dot` of side n in the step's dtype, 2·n³ FLOPs per call, timed like everything else
(median over repeats after warm-up). What a good program could reach on this machine today, in
this run (other load on a shared machine lowers it as much as the step's own figures).
`kernel_matmul_rate` times a product by its kernels alone, under the profiler: on a GPU the
wall-clock figure of long runs of products can sit well below what the same device's matmuls
reach inside a step (`jaxpi bench gpu` takes the larger).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxpi.bench.profile import matmul_events, trace_events
from jaxpi.bench.timing import rate, timed


def matmul_peak(
    n: int, dtype: str, *, warmup: int = 2, repeats: int = 5, kernel_timed: bool | None = None
) -> dict[str, Any]:
    """{"n", "dtype", "flop_per_s": figure, "flops_per_call", "mfu_peak", "mfu_peak_source"} for
    `a @ b`, both [n, n], timed on the wall clock.

    `kernel_timed` (None: on an accelerator, not on the CPU) also times the product by its
    kernels (`kernel_matmul_rate`, under "kernel_timed"); `mfu_peak` (FLOP/s, the MFU
    denominator) is then the larger median of the two ways, `mfu_peak_source` "wall" or "kernel".
    On an H200 the wall clock of long runs of products read 17 % below what the same GPU's
    matmul kernels reached inside a step (docs/performance.md, "The denominator again").
    """
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.dtype(dtype))
    b = jax.random.normal(kb, (n, n), jnp.dtype(dtype))
    dot = jax.jit(jnp.dot)
    times, _ = timed(lambda: dot(a, b), warmup=warmup, repeats=repeats)
    flops = 2.0 * n**3
    out: dict[str, Any] = {"n": n, "dtype": dtype, "flops_per_call": flops, "flop_per_s": rate(flops, times)}
    out["mfu_peak"], out["mfu_peak_source"] = out["flop_per_s"]["median"], "wall"
    if kernel_timed is None:
        kernel_timed = jax.devices()[0].platform != "cpu"
    if kernel_timed:
        try:
            out["kernel_timed"] = kernel_matmul_rate(n, n, n, dtype=dtype, reps=max(repeats, 3))
        except Exception as e:  # no profiler, no kernel events: the wall-clock figure stands
            out["kernel_timed"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        kernel = out["kernel_timed"].get("median_tflops", 0.0) * 1e12
        if kernel > out["mfu_peak"]:
            out["mfu_peak"], out["mfu_peak_source"] = kernel, "kernel"
    return out


def peak_probe(n: int, dtype: str, *, calls: int = 3) -> Callable[[], float]:
    """A compiled, warmed-up probe: each call times `calls` matmuls of side n and returns the
    median's FLOP/s (the peak of this moment, for an MFU against the load of the same moment)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.dtype(dtype))
    b = jax.random.normal(kb, (n, n), jnp.dtype(dtype))
    dot = jax.jit(jnp.dot)
    timed(lambda: dot(a, b), warmup=2, repeats=0)

    def probe() -> float:
        times, _ = timed(lambda: dot(a, b), warmup=0, repeats=calls)
        return rate(2.0 * n**3, times)["median"]

    return probe


def kernel_matmul_rate(
    m: int, k: int, n: int, *, dtype: str = "bfloat16", reps: int = 10, warmup_s: float = 2.0
) -> dict[str, Any]:
    """[m, k] @ [k, n] timed by its kernels' device time under the profiler (`jax.profiler`): the
    matmul's own rate, without dispatch or host synchronisation, after ≥ `warmup_s` of calls (the
    clocks ramp up from idle). On a GPU the kernels are CUPTI's; on the CPU XLA's thunks.
    Returns the median and best rate over `reps` calls (FLOP/s / 1e12) and the kernels' names."""
    a = jax.random.normal(jax.random.key(2), (m, k), jnp.dtype(dtype))
    b = (jax.random.normal(jax.random.key(3), (k, n), jnp.float32) * k**-0.5).astype(jnp.dtype(dtype))
    f = jax.jit(lambda a, b: a @ b)
    compiled = f.lower(a, b).compile()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:
        jax.block_until_ready(compiled(a, b))
    trace_dir = Path(tempfile.mkdtemp(prefix="jaxpi-matmul-trace-"))
    try:
        with jax.profiler.trace(str(trace_dir)):
            for _ in range(reps):
                jax.block_until_ready(compiled(a, b))
        events = matmul_events(trace_events(trace_dir), compiled.as_text())
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    # one call may run several kernels (a split-K reduction, say): time each call by the matmul
    # kernels it ran, taking the calls as the `reps` equal groups of events in time order
    events.sort(key=lambda e: e["ts"])
    if not events or len(events) % reps:
        raise RuntimeError(f"{len(events)} matmul kernel events for {reps} calls")
    per_call = len(events) // reps
    seconds = [
        sum(e["dur"] for e in events[i : i + per_call]) * 1e-6 for i in range(0, len(events), per_call)
    ]
    rates = [2.0 * m * k * n / x / 1e12 for x in seconds]
    return {
        "median_kernel_s": statistics.median(seconds),
        "median_tflops": statistics.median(rates),
        "max_tflops": max(rates),
        "kernels_per_call": per_call,
        "kernel_names": sorted({e["name"] for e in events}),
    }
