"""The matmul peak of this device, measured: the MFU denominator.

A square `jnp.dot` of side n in the step's dtype, 2·n³ FLOPs per call, timed like everything else
(median over repeats after warm-up). What a good program could reach on this machine today, in
this run (other load on a shared machine lowers it as much as the step's own figures).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpi.bench.timing import rate, timed


def matmul_peak(n: int, dtype: str, *, warmup: int = 2, repeats: int = 5) -> dict[str, Any]:
    """{"n", "dtype", "flop_per_s": figure, "flops_per_call"} for `a @ b`, both [n, n]."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.dtype(dtype))
    b = jax.random.normal(kb, (n, n), jnp.dtype(dtype))
    dot = jax.jit(jnp.dot)
    times, _ = timed(lambda: dot(a, b), warmup=warmup, repeats=repeats)
    flops = 2.0 * n**3
    return {"n": n, "dtype": dtype, "flops_per_call": flops, "flop_per_s": rate(flops, times)}


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
