"""The numbers of an agent evaluation (pure): the per-level table, the pooled pass rate, the text.

Per effort level, over the attempt records of one checkpoint:
- pass rate over admitted attempts with its 95% Wilson interval (`jaxpi.stats.levels.level_stats`,
  the same numbers `jaxpi report` prints for GRPO runs);
- mean reasoning tokens per admitted attempt with a 95% cluster-bootstrap interval over tasks;
- mean output tokens, turns and wall seconds per admitted attempt; the admitted share;
- mean tool calls per admitted attempt (all tools, and by tool in results.json) and model calls.

Records written before the tool and model counts existed lack those keys: the counts are unknown
there (None, printed "-"), never zero.

Two checkpoints on the same tasks are compared by `jaxpi.stats.paired.paired_difference` (a
bootstrap over tasks of the per-task difference in pass rate); `compare_text` prints it. Their
tool calls on the tasks both solve are compared by `jaxpi.stats.paired.paired_tool_calls`;
`tool_calls_text` prints that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpi.stats.intervals import estimate_json, wilson_interval
from jaxpi.stats.levels import N_BOOT, SEED, LevelStats, Summary, level_stats, ordering_ratios


def as_report_attempts(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attempt records (`AttemptRecord.to_json()`) in the attempts.jsonl shape `jaxpi.stats.levels` reads."""
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
    return [{"split": "eval", "step": 0, **{k: r[k] for k in keys}, "tool_calls": _tools(r)} for r in records]


def _tools(record: dict[str, Any]) -> int | None:
    """An attempt's tool calls, every tool together; None where the record has no count."""
    by_tool = record.get("tool_calls")
    return None if by_tool is None else sum(by_tool.values())


def _mean_if_all(values: Sequence[float | None]) -> float | None:
    """The mean, or None when there is nothing or some value is unknown."""
    return float(np.mean(values)) if values and None not in values else None


def summary(records: Sequence[dict[str, Any]], levels: Sequence[str], name: str) -> Summary:
    """A `jaxpi.stats.levels.Summary` of one evaluation (what its plots draw)."""
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
        by_tool = None
        if adm and all(r.get("tool_calls") is not None for r in adm):
            names = sorted({name for r in adm for name in r["tool_calls"]})
            by_tool = {n: float(np.mean([r["tool_calls"].get(n, 0) for r in adm])) for n in names}
        out[level] = {
            "attempts": s.scheduled,
            "admitted": s.admitted,
            "successes": s.successes,
            "pass_rate": estimate_json(s.pass_rate),
            "reasoning_tokens": estimate_json(s.reasoning_tokens),
            "output_tokens": s.output_tokens,
            "turns": s.turns,
            "wall_seconds": float(np.mean([r["wall_seconds"] for r in adm])) if adm else None,
            "tool_calls": s.tool_calls,
            "tool_calls_by_tool": by_tool,
            "model_calls": _mean_if_all([r.get("model_calls") for r in adm]),
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
        "tool calls",
        "model calls",
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
                _num(r.get("tool_calls"), ".1f"),  # .get: a table saved before these columns
                _num(r.get("model_calls"), ".1f"),
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


def tool_calls_text(changes: dict[str, dict[str, Any] | None], name_a: str, name_b: str) -> str:
    """`paired_tool_calls` per level (and "all", pooled) as lines: the mean per-task relative
    change, the mean per-task difference in calls, both with 95% intervals, and each run's mean."""
    lines = [
        f"tool calls on the tasks both solve, {name_a} vs {name_b} "
        "(per task: mean over its successes; bootstrap over tasks, 95%)"
    ]
    for level, c in changes.items():
        if c is None:
            lines.append(f"  {level:8s} no task solved by both (with a tool-call count)")
            continue
        rel = c["relative"]
        shown = (
            "no relative change: B made no call"
            if rel is None
            else f"{100 * rel['value']:+.0f}% [{100 * rel['lo']:+.0f}, {100 * rel['hi']:+.0f}]"
        )
        n = f"{c['tasks']} tasks"
        if rel is not None and c["relative_tasks"] < c["tasks"]:
            n += f", relative over the {c['relative_tasks']} where {name_b} made a call"
        d = c["difference"]
        lines.append(
            f"  {level:8s} {shown} ({n}); {d['value']:+.2f} calls [{d['lo']:+.2f}, {d['hi']:+.2f}]; "
            f"{name_a} {c['mean_a']:.2f}, {name_b} {c['mean_b']:.2f} per solved attempt"
        )
    return "\n".join(lines)
