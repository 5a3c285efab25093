"""The across-step pictures of `jaxpi report`, one colour per run (the frontier is
`jaxpi.stats.plots.frontier_figure`):
- `ordering.png`: each adjacent ratio across training steps with its band and a dashed line at
  1.0; a band wholly above the line is a violation beyond noise.
- `pass_rate.png`: per run, pass rate per level (Wilson bands) and T per level (bootstrap bands)
  across steps; dashed, the pass rate over scheduled attempts where it differs.

`ordering_figure` and `pass_rate_figure` build the `Figure`s; `plot_*` write them. Steps have
integer ticks and one legend below the axes names every line style (`jaxpi.stats.plots`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpi.stats.levels import Summary, initials
from jaxpi.stats.plots import colours, figure_legend, new_figure, save_png, step_axis

THRESHOLD_LABEL = "1.0: equal T (above: the lower level reasons longer)"


def ordering_figure(series: Sequence[Sequence[Summary]]) -> Any:
    """Each adjacent ordering ratio across steps, one line + band per run, dashed 1.0."""
    levels = series[0][0].levels
    pairs = [f"{levels[j]}/{levels[j + 1]}" for j in range(len(levels) - 1)]
    ini = initials(levels)
    fig = new_figure((5.5 * max(1, len(pairs)), 4.5))
    axes = fig.subplots(1, max(1, len(pairs)), squeeze=False)
    cols = colours(len(series))
    steps = sorted({s.step for run_series in series for s in run_series})
    for j, pair in enumerate(pairs):
        ax = axes[0, j]
        for run_series, colour in zip(series, cols, strict=True):
            pts = [(s.step, s.ordering[pair]) for s in run_series if s.ordering.get(pair) is not None]
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1].value for p in pts], "o-", color=colour, label=run_series[0].run, ms=3)
            ax.fill_between(x, [p[1].lo for p in pts], [p[1].hi for p in pts], color=colour, alpha=0.2)
        ax.axhline(1.0, color="k", ls="--", lw=1, label=THRESHOLD_LABEL)
        ax.set_title(f"T_{ini[j]} / T_{ini[j + 1]}  ({pair})", fontsize="medium")
        step_axis(ax, steps)
        ax.grid(alpha=0.3)
    if not pairs:
        axes[0, 0].text(
            0.5, 0.5, "one effort level: no ordering ratios", ha="center", transform=axes[0, 0].transAxes
        )
        step_axis(axes[0, 0], steps)
    axes[0, 0].set_ylabel("T lower / T upper level\n(95% bootstrap band)")
    figure_legend(fig, list(axes.flat))
    return fig


def pass_rate_figure(series: Sequence[Sequence[Summary]]) -> Any:
    """Per run (columns): pass rate per level (top; dashed, without a band: over scheduled
    attempts, drawn where it differs) and T per level (bottom) across steps."""
    n = len(series)
    fig = new_figure((5.5 * n, 7.5))
    axes = fig.subplots(2, n, squeeze=False, sharex="col")
    for col, run_series in enumerate(series):
        levels = run_series[0].levels
        for level, colour in zip(levels, colours(len(levels)), strict=True):
            for row, field in enumerate(("pass_rate", "reasoning_tokens")):
                pts = [(s.step, getattr(s.stats[level], field)) for s in run_series]
                pts = [(x, e) for x, e in pts if e is not None]
                if not pts:
                    continue
                x = [p[0] for p in pts]
                ax = axes[row, col]
                ax.plot(x, [p[1].value for p in pts], "o-", color=colour, label=level, ms=3)
                ax.fill_between(x, [p[1].lo for p in pts], [p[1].hi for p in pts], color=colour, alpha=0.2)
            sched = [(s.step, s.stats[level].pass_rate_scheduled) for s in run_series]
            sched = [(x, e.value) for x, e in sched if e is not None]
            if any(s.stats[level].admitted < s.stats[level].scheduled for s in run_series) and sched:
                axes[0, col].plot(
                    *zip(*sched, strict=True), "--", color=colour, lw=1, label=f"{level}, over scheduled"
                )
        axes[0, col].set_title(f"{run_series[0].run} ({run_series[0].split})")
        axes[0, col].set_ylim(-0.02, 1.02)
        step_axis(axes[1, col], [s.step for s in run_series])
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("pass rate, over admitted attempts\n(95% Wilson band)")
    axes[1, 0].set_ylabel("reasoning tokens / attempt\n(95% bootstrap band)")
    fig.align_ylabels(axes[:, 0])
    figure_legend(fig, list(axes.flat), ncol=6)
    return fig


def plot_ordering(series: Sequence[Sequence[Summary]], path: str | os.PathLike) -> Path:
    """Write `ordering_figure(series)` as a PNG at `path`."""
    return save_png(ordering_figure(series), path)


def plot_pass_rate(series: Sequence[Sequence[Summary]], path: str | os.PathLike) -> Path:
    """Write `pass_rate_figure(series)` as a PNG at `path`."""
    return save_png(pass_rate_figure(series), path)
