"""The paired difference of two sets of attempts on the same tasks, with a task bootstrap.

Per task the difference of pass rates d_t = p_A,t − p_B,t (each over that task's admitted
attempts at the level), then the mean over tasks present in both, with a 95% percentile interval
from a bootstrap over tasks (tasks resampled with replacement, fixed seed). Resampling tasks, not
attempts, keeps a task's attempts together: they share its difficulty. With one attempt per task
this is the usual paired bootstrap of McNemar's setting; an interval excluding 0 is a difference
beyond task noise.
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
