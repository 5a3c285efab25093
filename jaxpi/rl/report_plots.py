"""The across-step pictures of `jaxpi report`, one colour per run (the frontier is
`jaxpi.stats.plots.plot_frontier`):
- `ordering.png`: each adjacent ratio across training steps with its band and a dashed line at
  1.0; a band wholly above the line is a violation beyond noise.
- `pass_rate.png`: per run, pass rate per level (Wilson bands) and T per level (bootstrap bands)
  across steps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from jaxpi.stats.levels import Summary, initials
from jaxpi.stats.plots import colours, pyplot, save_png


def plot_ordering(series: Sequence[Sequence[Summary]], path: str | os.PathLike) -> Path:
    """Each adjacent ordering ratio across steps, one line + band per run, dashed 1.0."""
    plt = pyplot()
    levels = series[0][0].levels
    pairs = [f"{levels[j]}/{levels[j + 1]}" for j in range(len(levels) - 1)]
    ini = initials(levels)
    fig, axes = plt.subplots(1, max(1, len(pairs)), figsize=(5.5 * max(1, len(pairs)), 4), squeeze=False)
    cols = colours(len(series))
    for j, pair in enumerate(pairs):
        ax = axes[0, j]
        for run_series, colour in zip(series, cols, strict=True):
            pts = [(s.step, s.ordering[pair]) for s in run_series if s.ordering.get(pair) is not None]
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1].value for p in pts], "o-", color=colour, label=run_series[0].run, ms=3)
            ax.fill_between(x, [p[1].lo for p in pts], [p[1].hi for p in pts], color=colour, alpha=0.2)
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_title(f"T_{ini[j]}/T_{ini[j + 1]} ({pair}); above 1 = violation", fontsize="medium")
        ax.set_xlabel("step (policy updates)")
        ax.grid(alpha=0.3)
    if not pairs:
        axes[0, 0].text(
            0.5, 0.5, "one effort level: no ordering ratios", ha="center", transform=axes[0, 0].transAxes
        )
    axes[0, 0].set_ylabel("reasoning tokens, lower / upper level")
    if pairs:
        axes[0, 0].legend(fontsize="small")
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)


def plot_pass_rate(series: Sequence[Sequence[Summary]], path: str | os.PathLike) -> Path:
    """Per run (columns): pass rate per level (top; dashed, without a band: over scheduled
    attempts, drawn where it differs) and T per level (bottom) across steps."""
    plt = pyplot()
    n = len(series)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n, 7), squeeze=False, sharex="col")
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
                axes[0, col].plot(*zip(*sched, strict=True), "--", color=colour, lw=1)
        axes[0, col].set_title(f"{run_series[0].run} ({run_series[0].split})")
        axes[0, col].set_ylim(-0.02, 1.02)
        axes[1, col].set_xlabel("step (policy updates)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
        axes[0, col].legend(fontsize="small")
    axes[0, 0].set_ylabel("pass rate (95% Wilson); dashed: of scheduled")
    axes[1, 0].set_ylabel("reasoning tokens / attempt (95% bootstrap)")
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)
