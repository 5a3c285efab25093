"""The paired difference of two sets of attempts on the same tasks, with a task bootstrap.

Per task the difference of pass rates d_t = p_A,t − p_B,t (each over that task's admitted
attempts at the level), then the mean over tasks present in both, with a 95% percentile interval
from a bootstrap over tasks (tasks resampled with replacement, fixed seed). Resampling tasks, not
attempts, keeps a task's attempts together: they share its difficulty. With one attempt per task
this is the usual paired bootstrap of McNemar's setting; an interval excluding 0 is a difference
beyond task noise.

`paired_tool_calls` compares tool calls on the tasks both sets solve (below, with its equations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpi.stats.levels import N_BOOT, SEED


def _per_task(records: Sequence[dict[str, Any]], level: str | None) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for r in records:
        if r["admitted"] and (level is None or r["level"] == level):
            hits.setdefault(r["task_id"], []).append(bool(r["success"]))
    return {t: float(np.mean(v)) for t, v in hits.items()}


def paired_difference(
    a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], level: str | None, *, n_boot: int = N_BOOT
) -> dict[str, Any] | None:
    """Mean over shared tasks of pass(A) − pass(B) at `level` (None: levels pooled), bootstrap 95%."""
    pa, pb = _per_task(a, level), _per_task(b, level)
    tasks = sorted(set(pa) & set(pb))
    if not tasks:
        return None
    d = np.array([pa[t] - pb[t] for t in tasks])
    rng = np.random.default_rng(SEED)
    # idx[b, i]: the task drawn i-th in resample b.
    idx = rng.integers(0, len(tasks), size=(n_boot, len(tasks)))
    # Fixed seed: a rerun prints the same interval, so two reports differ only where the data does.
    boots = d[idx].mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    per_task = {t: float(x) for t, x in zip(tasks, d, strict=True)}
    return {
        "value": float(d.mean()),
        "lo": float(lo),
        "hi": float(hi),
        "tasks": len(tasks),
        "per_task": per_task,
    }


def _solved_calls(records: Sequence[dict[str, Any]], level: str | None) -> dict[str, float]:
    """Per task: mean tool calls over its admitted successes with a count at `level` (None: any)."""
    calls: dict[str, list[int]] = {}
    for r in records:
        n = r.get("tool_calls")
        if r["admitted"] and r["success"] and n is not None and (level is None or r["level"] == level):
            calls.setdefault(r["task_id"], []).append(int(n))
    return {t: float(np.mean(v)) for t, v in calls.items()}


def _boot_mean(x: np.ndarray, n_boot: int) -> tuple[float, float]:
    """95% percentile interval of the mean of `x` over tasks resampled with replacement (fixed seed)."""
    idx = np.random.default_rng(SEED).integers(0, len(x), size=(n_boot, len(x)))
    lo, hi = np.percentile(x[idx].mean(axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def paired_tool_calls(
    a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], level: str | None, *, n_boot: int = N_BOOT
) -> dict[str, Any] | None:
    """Tool calls of A against B on the tasks both solve at `level` (None: levels pooled).

    Records are attempts.jsonl-shaped dicts (`task_id`, `level`, `admitted`, `success`, and
    `tool_calls`, an int; missing or None: not counted, so the attempt is left out). Per run and
    task t, over the run's admitted successes at the level that carry a count:

        c_A,t = mean tool calls of A's successes on t        (likewise c_B,t)
        P     = { t : A and B each have at least one such success on t }   (the paired set)
        Δ_t   = c_A,t − c_B,t                                 t ∈ P          (absolute, calls)
        ρ_t   = (c_A,t − c_B,t) / c_B,t                       t ∈ P, c_B,t > 0   (relative)
        Δ     = mean_{t ∈ P} Δ_t,   ρ = mean ρ_t

    Each with a 95% percentile interval from a bootstrap over its tasks (resampled with
    replacement, fixed seed, as `paired_difference`). ρ = −0.37 reads "37% fewer tool calls than
    B on the tasks both solve" (the TwIL-8B-pi card's "−37% (112 tasks)"). Tasks on which B's
    successes made no call at all have no relative change: they count in Δ, not in ρ
    (`relative_tasks` says how many are left). Swapping A and B negates Δ and every Δ_t; ρ is not
    antisymmetric (a ratio's change is not). Pooled over levels, a task's c is the mean over its
    successes at every level. None when no task is solved by both.
    """
    ca, cb = _solved_calls(a, level), _solved_calls(b, level)
    tasks = sorted(set(ca) & set(cb))
    if not tasks:
        return None
    xa = np.array([ca[t] for t in tasks])
    xb = np.array([cb[t] for t in tasks])
    d = xa - xb
    lo, hi = _boot_mean(d, n_boot)
    out: dict[str, Any] = {
        "tasks": len(tasks),
        "mean_a": float(xa.mean()),
        "mean_b": float(xb.mean()),
        "difference": {"value": float(d.mean()), "lo": lo, "hi": hi},
        "relative": None,
        "relative_tasks": int((xb > 0).sum()),
        "per_task": {t: {"a": float(x), "b": float(y)} for t, x, y in zip(tasks, xa, xb, strict=True)},
    }
    if (xb > 0).any():
        rho = d[xb > 0] / xb[xb > 0]
        rlo, rhi = _boot_mean(rho, n_boot)
        out["relative"] = {"value": float(rho.mean()), "lo": rlo, "hi": rhi}
    return out
