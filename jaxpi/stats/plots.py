"""The pictures' common parts and the frontier: pass rate against mean reasoning tokens per
effort level, drawn for GRPO runs (`jaxpi report`) and agent evaluations (`jaxpi eval`).

matplotlib is imported on first use (Agg, files only), so importing this module stays light.
A PNG is written beside its destination and renamed into place: a reader never sees half a PNG.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpi.atomic import atomic_file
from jaxpi.stats.levels import Summary, initials


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def colours(n: int) -> list[Any]:
    """`n` colours of the tab10 cycle."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def save_png(fig: Any, path: str | os.PathLike) -> Path:
    """Write the figure as a PNG atomically, with the umask's permissions (not mkstemp's 0600)."""
    path = Path(path)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
    return path


def _frontier_layer(ax: Any, s: Summary, colour: Any, alpha: float, label: str | None) -> None:
    """One summary on the pass-rate / reasoning-tokens plane: points, both intervals, arrows."""
    ini = initials(s.levels)
    pts = []
    for e, tag in zip(s.levels, ini, strict=True):
        st = s.stats[e]
        if st.pass_rate is None or st.reasoning_tokens is None:
            continue
        x, y = st.reasoning_tokens, st.pass_rate
        ax.errorbar(
            x.value,
            y.value,
            xerr=[[x.value - x.lo], [x.hi - x.value]],
            yerr=[[y.value - y.lo], [y.hi - y.value]],
            fmt="o",
            color=colour,
            alpha=alpha,
            capsize=3,
            label=label if not pts else None,
        )
        ax.annotate(
            tag, (x.value, y.value), textcoords="offset points", xytext=(6, 6), color=colour, alpha=alpha
        )
        pts.append((x.value, y.value))
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops={
                "arrowstyle": "->",
                "color": colour,
                "alpha": alpha,
                "lw": 1.5,
                "shrinkA": 6,
                "shrinkB": 6,
            },
        )


def plot_frontier(runs: Sequence[tuple[Summary, Summary]], path: str | os.PathLike) -> Path:
    """Pass rate vs mean reasoning tokens per attempt: per run its (first, last) summaries, one point
    per level with both 95% intervals and arrows L→M→X, the first faded and the last solid."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    cols = colours(len(runs))
    for i, ((first, last), colour) in enumerate(zip(runs, cols, strict=True)):
        if i == 0 and first.step != last.step:
            # With several runs the first run's start is the common start, drawn once in grey.
            start_colour = "0.45" if len(runs) > 1 else colour
            _frontier_layer(ax, first, start_colour, 0.4, f"start (step {first.step})")
        _frontier_layer(ax, last, colour, 1.0, f"{last.run} (step {last.step})")
    ax.set_xlabel("mean reasoning tokens per attempt")
    ax.set_ylabel("pass rate")
    ax.set_ylim(-0.02, 1.08)  # room for the level labels above a 100% point
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    split = runs[0][1].split
    ax.set_title(f"Pass rate vs reasoning by effort level ({split}, 95% intervals)")
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)
