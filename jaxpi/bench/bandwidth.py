"""The memory bandwidth of this device, measured: the denominator of decode's bandwidth fraction.

A decode step at a small batch reads every weight once and the cache rows of every live sequence,
and does about one multiply-add per weight per row: its ceiling is the rate at which memory
delivers bytes, not the matmul peak. The probe is a copy: `a + 1` over a large float32 array
whose buffer is donated, so the result is written in place (`2 · size` bytes per call: one read,
one write) and no call pays for fresh pages. Timed in the same process as the engine, like every
other figure, so other load on a shared machine lowers it as much as the engine's rates.

    fraction = bytes moved per decode step × steps per second / copy bandwidth
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpi.bench.timing import figure

# Far larger than any last-level cache here (32 MiB on the 2-core CPU), small enough for any host.
PROBE_BYTES = 256 * 1024**2


def bandwidth_probe(nbytes: int = PROBE_BYTES, *, calls: int = 3) -> Callable[[], float]:
    """A function that measures the copy bandwidth now (bytes/s, the median of `calls` timed
    calls); the array is allocated and the program compiled and warmed up once, here."""
    if nbytes < 4096:
        raise ValueError(f"the bandwidth probe needs at least 4096 bytes, got {nbytes}")
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    holder = [step(jnp.zeros((nbytes // 4,), jnp.float32))]  # the buffer lives across calls
    jax.block_until_ready(holder[0])

    def probe() -> float:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            holder[0] = step(holder[0])
            jax.block_until_ready(holder[0])
            times.append(time.perf_counter() - t0)
        return 2.0 * holder[0].nbytes / statistics.median(times)

    return probe


def copy_bandwidth(nbytes: int = PROBE_BYTES, *, repeats: int = 5) -> dict[str, Any]:
    """{"bytes_per_call", "bytes_per_s": figure} of the donated in-place copy, `repeats` probes."""
    probe = bandwidth_probe(nbytes)
    return {"bytes_per_call": 2 * (nbytes // 4) * 4, "bytes_per_s": figure([probe() for _ in range(repeats)])}
