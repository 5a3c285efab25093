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


def interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    warmup: int,
    repeats: int,
    before: Callable[[str, int], None] | None = None,
    after: Callable[[str, int], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """`timed` for several functions whose timed calls alternate: every function is warmed up
    first, then repeat i calls each in turn (a, b, a, b, ...), so a pair of calls runs back to
    back under about the same load of a shared machine. `before(name, i)` and `after(name, i)` run
    untimed right before and after each timed call (e.g. a fresh matmul-peak probe).

    Returns ({name: seconds per repeat}, {name: seconds of its first warm-up call}).
    """
    first: dict[str, float] = {}
    for name, fn in fns.items():
        if progress:
            progress(f"warm-up: {name}")
        first[name] = timed(fn, warmup=warmup, repeats=0)[1]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before(name, i)
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
            if after is not None:
                after(name, i)
            if progress:
                progress(f"repeat {i + 1}/{repeats}: {name} {times[name][-1]:.3g} s")
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


def pair_ratios(slow: Sequence[float], fast: Sequence[float]) -> dict[str, Any]:
    """The figure of `slow_i / fast_i` over paired repeats (e.g. torch time over jaxpi time of
    the calls made back to back): a ratio each pair measured under the same load."""
    if len(slow) != len(fast):
        raise ValueError(f"paired repeats differ in number: {len(slow)} and {len(fast)}")
    return figure([s / f for s, f in zip(slow, fast, strict=True)])
