"""The numbers of an agent evaluation (pure): the per-level table, paired comparisons, rankings.

Per effort level, over the attempt records of one checkpoint:
- pass rate over admitted attempts with its 95% Wilson interval (`jaxpi.rl.report.level_stats`,
  the same numbers `jaxpi report` prints for GRPO runs);
- mean reasoning tokens per admitted attempt with a 95% cluster-bootstrap interval over tasks;
- mean output tokens, turns and wall seconds per admitted attempt; the admitted share.

Paired comparison of checkpoints A and B on the same tasks (`paired_difference`): per task the
difference of pass rates d_t = p_A,t − p_B,t (each over that task's admitted attempts at the
level), then the mean over tasks present in both, with a 95% percentile interval from a bootstrap
over tasks (tasks resampled with replacement, fixed seed). Resampling tasks, not attempts, keeps a
task's attempts together: they share its difficulty. With one attempt per task this is the usual
paired bootstrap of McNemar's setting; an interval excluding 0 is a difference beyond task noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpi.rl.report import Estimate, LevelStats, Summary, level_stats, ordering_ratios, wilson_interval

N_BOOT = 2000
SEED = 0


def as_report_attempts(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attempt records (`AttemptRecord.to_json()`) in the attempts.jsonl shape `jaxpi.rl.report` reads."""
    keys = (
        "task_id",
        "level",
        "admitted",
        "success",
        "reasoning_tokens",
        "output_tokens",
        "turns",
        "attempt_id",
    )
    return [{"split": "eval", "step": 0, **{k: r[k] for k in keys}} for r in records]


def summary(records: Sequence[dict[str, Any]], levels: Sequence[str], name: str) -> Summary:
    """A `jaxpi.rl.report.Summary` of one evaluation (what its plots draw)."""
    att = as_report_attempts(records)
    return Summary(
        run=name,
        split="eval",
        step=0,
        first_step=0,
        levels=tuple(levels),
        stats=level_stats(att, levels, n_boot=N_BOOT, seed=SEED),
        ordering=ordering_ratios(att, levels, n_boot=N_BOOT, seed=SEED),
        tasks=len({r["task_id"] for r in records}),
    )


def _est(e: Estimate | None) -> dict[str, float] | None:
    return None if e is None else {"value": e.value, "lo": e.lo, "hi": e.hi}


def level_table(records: Sequence[dict[str, Any]], levels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per level: the `LevelStats` numbers plus mean wall seconds and the not-admitted reasons."""
    stats: dict[str, LevelStats] = level_stats(as_report_attempts(records), levels, n_boot=N_BOOT, seed=SEED)
    out = {}
    for level in levels:
        s = stats[level]
        at = [r for r in records if r["level"] == level]
        adm = [r for r in at if r["admitted"]]
        reasons: dict[str, int] = {}
        for r in at:
            if not r["admitted"]:
                reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        out[level] = {
            "attempts": s.scheduled,
            "admitted": s.admitted,
            "successes": s.successes,
            "pass_rate": _est(s.pass_rate),
            "reasoning_tokens": _est(s.reasoning_tokens),
            "output_tokens": s.output_tokens,
            "turns": s.turns,
            "wall_seconds": float(np.mean([r["wall_seconds"] for r in adm])) if adm else None,
            "not_admitted": reasons,
        }
    return out


def overall_pass_rate(records: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Pass rate over every admitted attempt (all levels pooled) with its Wilson interval."""
    adm = [r for r in records if r["admitted"]]
    if not adm:
        return None
    k = sum(bool(r["success"]) for r in adm)
    lo, hi = wilson_interval(k, len(adm))
    return {"value": k / len(adm), "lo": lo, "hi": hi, "n": len(adm)}


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


def _pct(e: dict[str, float] | None) -> str:
    return "-" if e is None else f"{100 * e['value']:.0f}% [{100 * e['lo']:.0f}, {100 * e['hi']:.0f}]"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def table_text(table: dict[str, dict[str, Any]], title: str) -> str:
    """The per-level table as aligned text."""
    head = (
        "level",
        "pass rate (95% CI)",
        "n",
        "reasoning tok",
        "output tok",
        "turns",
        "wall s",
        "not admitted",
    )
    rows = [head]
    for level, r in table.items():
        rt = r["reasoning_tokens"]
        rows.append(
            (
                level,
                _pct(r["pass_rate"]),
                f"{r['admitted']}/{r['attempts']}",
                "-" if rt is None else f"{rt['value']:.0f} [{rt['lo']:.0f}, {rt['hi']:.0f}]",
                _num(r["output_tokens"]),
                _num(r["turns"], ".1f"),
                _num(r["wall_seconds"], ".1f"),
                ", ".join(f"{k} {v}" for k, v in sorted(r["not_admitted"].items())) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [title] + [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)


def compare_text(diffs: dict[str, dict[str, Any] | None], name_a: str, name_b: str) -> str:
    lines = [f"paired difference in pass rate, {name_a} - {name_b} (bootstrap over tasks, 95%)"]
    for level, d in diffs.items():
        if d is None:
            lines.append(f"  {level:8s} no shared tasks")
        else:
            lines.append(
                f"  {level:8s} {100 * d['value']:+.0f} pts [{100 * d['lo']:+.0f}, {100 * d['hi']:+.0f}] over {d['tasks']} tasks"
            )
    return "\n".join(lines)
