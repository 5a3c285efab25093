"""Reading GRPO runs into a comparison table and three pictures (`jaxpi report RUN_DIR...`).

The runs are read by `jaxpi.rl.runs` (run.json + attempts.jsonl); the numbers per effort level
(pass rates over admitted and over scheduled attempts with 95% Wilson intervals, mean reasoning
tokens T with a 95% bootstrap over tasks, the ordering ratios T_lower / T_upper) are
`jaxpi.stats.levels`'. The admitted pass rate alone hides format breakage (a level that breaks the
format more often keeps its admitted pass rate); the gap to the scheduled one is what
non-admission cost.

The pictures, written into `RUN_DIR/report/` (or `--out`), one colour per run:
- `frontier.png`: pass rate against T, one point per level with both 95% intervals as error bars
  and arrows L→M→X in effort order, at the first step (faded) and the last (solid). A run whose
  arrows point up and to the right is ordered; an arrow pointing left is a violation. With several
  runs, the first run's start is drawn once as the common start (`jaxpi.stats.plots`).
- `ordering.png`, `pass_rate.png`: the ratios, and pass rate and T per level, across steps
  (`jaxpi.rl.report_plots`).
- `report.json`: the first and last summaries of every run and the table text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpi import atomic
from jaxpi.rl.report_plots import plot_ordering, plot_pass_rate
from jaxpi.rl.runs import load_run, step_series, summarize
from jaxpi.stats.intervals import Estimate
from jaxpi.stats.levels import Summary, initials
from jaxpi.stats.plots import plot_frontier
from jaxpi.stats.table import finite, markdown_table


def _pct(e: Estimate | None) -> str:
    return "–" if e is None else f"{100 * e.value:.1f}% [{100 * e.lo:.0f}, {100 * e.hi:.0f}]"


def _tokens(e: Estimate | None) -> str:
    return "–" if e is None else f"{e.value:,.0f}"


def _ratio(e: Estimate | None) -> str:
    if e is None:
        return "–"
    text = f"{e.value:.2f} [{e.lo:.2f}, {e.hi:.2f}]"
    return f"**{text}**" if e.value > 1.0 else text  # bold: an ordering violation


def comparison_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """A Markdown table, one row per named summary: per-level pass rate over admitted and over
    scheduled attempts (95% Wilson), mean reasoning tokens per attempt, and the adjacent ordering
    ratios (95% task bootstrap)."""
    if not rows:
        raise ValueError("comparison_table needs at least one row")
    levels = rows[0][1].levels
    for name, s in rows:
        if s.levels != levels:
            raise ValueError(f"row {name!r} has levels {list(s.levels)}, the first row {list(levels)}")
    ini = initials(levels)
    pairs = [f"{levels[j]}/{levels[j + 1]}" for j in range(len(levels) - 1)]
    header = (
        ["", "step", "tasks"]
        + [f"pass {e}" for e in ini]
        + [f"sched {e}" for e in ini]
        + [f"T {e}" for e in ini]
        + [f"T_{ini[j]}/T_{ini[j + 1]}" for j in range(len(pairs))]
    )
    body = []
    for name, s in rows:
        step = str(s.step) if s.first_step == s.step else f"{s.first_step}–{s.step}"
        body.append(
            [name, step + ("" if s.split == "eval" else " (train)"), str(s.tasks)]
            + [_pct(s.stats[e].pass_rate) for e in levels]
            + [_pct(s.stats[e].pass_rate_scheduled) for e in levels]
            + [_tokens(s.stats[e].reasoning_tokens) for e in levels]
            + [_ratio(s.ordering[p]) for p in pairs]
        )
    legend = ", ".join(f"{a} = {e}" for a, e in zip(ini, levels, strict=True) if a != e)
    foot = (
        (f"{legend}. " if legend else "")
        + "pass: pass rate over admitted attempts [95% Wilson]. sched: admitted successes over scheduled "
        "attempts, non-admitted (malformed) ones counted as failures [95% Wilson]. T: mean reasoning "
        "tokens per admitted attempt. Ratios: T_lower/T_upper [95% bootstrap over tasks]; bold above 1.00 = ordering violation."
    )
    notes = sorted({s.note for _, s in rows if s.note})
    return "\n".join([markdown_table(header, body), "", foot, *notes])


def build_report(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike | None = None,
    split: str = "eval",
    window: int = 1,
) -> dict[str, Any]:
    """Load the runs, write the three pictures and report.json into `out` (default: the first
    run's `report/`), and return report.json's content."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    levels = runs[0].levels
    for r in runs[1:]:
        if r.levels != levels:
            raise ValueError(f"{r.path}: levels {list(r.levels)} differ from {runs[0].path}'s {list(levels)}")
    out_dir = Path(out) if out is not None else runs[0].path / "report"
    ends = [(summarize(r, split, "first"), summarize(r, split, "last")) for r in runs]
    rows = [("start", ends[0][0])] + [(last.run, last) for _, last in ends]
    table = comparison_table(rows)
    series = [step_series(r, split, window) for r in runs]
    images = [
        plot_frontier(ends, out_dir / "frontier.png"),
        plot_ordering(series, out_dir / "ordering.png"),
        plot_pass_rate(series, out_dir / "pass_rate.png"),
    ]
    report = {
        "runs": [
            {
                "name": r.name,
                "dir": str(r.path),
                "reward_kind": r.reward_kind,
                "skipped_truncated_line": r.skipped_last_line,
                "first": first.to_json(),
                "last": last.to_json(),
            }
            for r, (first, last) in zip(runs, ends, strict=True)
        ],
        "table": table,
        "images": [str(p) for p in images],
    }
    atomic.write_text(out_dir / "report.json", json.dumps(finite(report), indent=2) + "\n")
    return report
