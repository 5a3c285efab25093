"""The scalars a GRPO run logs per update (metrics.jsonl, TensorBoard) and its one-line progress.

    level/<level>/...       the reward module's per-level summary, the admitted share, reasoning
                            tokens per turn (under "eval/" for the evaluation collections)
    ordering/<a>/<b>        T_a / T_b of adjacent levels
    logp_diff_*, is_*       the trainer-vs-engine log-prob gap and the importance weights

Undefined numbers (a level without an admitted attempt) are left out, not written as zeros.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpi.envs.agent_loop import Trajectory
from jaxpi.rl.reward import CollectionScore


def level_metrics(
    prefix: str, trajectories: Sequence[Trajectory], score: CollectionScore, levels: Sequence[str]
) -> dict[str, float]:
    """Per-level scalars of one collection: the reward module's summary plus the admitted share
    and reasoning tokens per turn, under `prefix` ("" for training, "eval/" for evaluation)."""
    out = {f"{prefix}{k}": v for k, v in score.metrics().items()}
    for level in levels:
        mine = [t for t in trajectories if t.level == level]
        kept = [t for t in mine if t.admitted]
        if mine:
            out[f"{prefix}level/{level}/admitted_share"] = len(kept) / len(mine)
        if kept:
            out[f"{prefix}level/{level}/reasoning_per_turn"] = float(
                np.mean([t.reasoning_tokens / max(t.turns, 1) for t in kept])
            )
    return out


def engine_gap_metrics(
    logp_old: np.ndarray, logp_engine: np.ndarray, mask: np.ndarray, cap: float | None
) -> dict[str, float]:
    """Trainer-vs-engine log-prob gap and the importance weights the loss will use, on the
    supervised tokens (the loss's own view of them, before the update)."""
    on = mask[:, 1:] > 0
    if not on.any():
        return {}
    diff = (logp_old[:, 1:] - logp_engine[:, 1:])[on]
    w = np.exp(diff)
    out = {
        "logp_diff_mean": float(np.mean(np.abs(diff))),
        "logp_diff_max": float(np.max(np.abs(diff))),
        "is_weight_mean": float(np.mean(np.minimum(w, cap) if cap else w)),
        "is_weight_max": float(np.max(np.minimum(w, cap) if cap else w)),
    }
    if cap:
        out["is_capped_frac"] = float(np.mean(w > cap))
    return out


def levels_line(m: dict[str, Any], levels: Sequence[str], prefix: str) -> str:
    """Pass rate / mean reasoning tokens per level and the ordering ratios, for the progress lines."""
    parts = []
    for level in levels:
        p, t = (
            m.get(f"{prefix}level/{level}/pass_rate"),
            m.get(f"{prefix}level/{level}/mean_reasoning_tokens"),
        )
        parts.append(f"{level} {'-' if p is None else f'{p:.2f}'}/{'-' if t is None else f'{t:.0f}'}t")
    ratios = [
        f"T_{a[0].upper()}/T_{b[0].upper()} {m[f'{prefix}ordering/{a}/{b}']:.2f}"
        for a, b in itertools.pairwise(levels)
        if f"{prefix}ordering/{a}/{b}" in m
    ]
    return "pass/reasoning " + ", ".join(parts) + (" | " + ", ".join(ratios) if ratios else "")
