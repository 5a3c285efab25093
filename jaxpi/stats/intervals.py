"""95% intervals: Wilson for a proportion, percentile for bootstrap resamples, Student's t over
independent replicates (seeds)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile

# t_{0.975} for 1..30 degrees of freedom (scipy.stats.t.ppf, six decimals).
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157,
    2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
    2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831,
    2.048407, 2.045230, 2.042272,
)  # fmt: skip


class Estimate(NamedTuple):
    """A point estimate with its 95% interval. Wilson intervals always contain the value; a
    percentile bootstrap interval does except for pathologically skewed resamples."""

    value: float
    lo: float
    hi: float


def estimate_json(e: Estimate | None) -> dict[str, float] | None:
    """`{"value", "lo", "hi"}`, as the reports' JSON files hold an estimate."""
    return None if e is None else {"value": e.value, "lo": e.lo, "hi": e.hi}


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion:
    (p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n), p = successes / n."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At 0/n (n/n) the lower (upper) bound is exactly 0 (1); set it so rounding cannot leave p̂ outside.
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def percentile_interval(samples: np.ndarray, value: float) -> Estimate:
    """`value` with the 2.5% and 97.5% percentiles of the finite bootstrap `samples` (a point
    interval when none is finite)."""
    ok = samples[np.isfinite(samples)]
    if ok.size == 0:
        return Estimate(value, value, value)
    lo, hi = np.percentile(ok, [2.5, 97.5])
    return Estimate(float(value), float(lo), float(hi))


def t_quantile(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a table to 30, then the
    Cornish-Fisher expansion around the normal, within 1e-4 there)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float | None]) -> Estimate | None:
    """Mean with its 95% t-interval over independent replicates (seeds); NaN bounds for one value,
    None for none. Values that are None (undefined in that replicate) are left out."""
    xs = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    if xs.size == 0:
        return None
    mean = float(xs.mean())
    if xs.size == 1:
        return Estimate(mean, math.nan, math.nan)
    half = t_quantile(xs.size - 1) * float(xs.std(ddof=1)) / math.sqrt(xs.size)
    return Estimate(mean, mean - half, mean + half)
