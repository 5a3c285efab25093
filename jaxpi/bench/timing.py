"""Timing with warm-up, and figures as median / min / max over the timed repeats.

Every timed call blocks on its result (`jax.block_until_ready`; torch on CPU is synchronous), so a
time is the work done, not the time to enqueue it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def timed(fn: Callable[[], Any], *, warmup: int, repeats: int) -> tuple[list[float], float]:
    """(seconds of each of `repeats` timed calls, seconds of the first warm-up call).

    The first call compiles (jax) or allocates (torch), so it is reported apart and never timed
    into the figures.
    """
    first = 0.0
    for i in range(warmup):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if i == 0:
            first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times, first


def figure(values: Sequence[float]) -> dict[str, Any]:
    """{"median", "min", "max", "repeats", "values"} of per-repeat values."""
    vals = [float(v) for v in values]
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "repeats": len(vals),
        "values": vals,
    }


def rate(amount: float, times: Sequence[float]) -> dict[str, Any]:
    """The figure of `amount / t` over the per-repeat times (tokens/s, FLOP/s)."""
    return figure([amount / t for t in times])


def ratio(num: dict[str, Any], den: dict[str, Any]) -> float:
    """Median over median of two figures."""
    return num["median"] / den["median"]
