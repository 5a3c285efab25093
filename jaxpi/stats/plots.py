"""The pictures' common parts and the frontier: pass rate against mean reasoning tokens per
effort level, drawn for GRPO runs (`jaxpi report`) and agent evaluations (`jaxpi eval`); and the
tool calls of two evaluations on the tasks both solve (`jaxpi eval --compare`).

matplotlib is imported on first use (Agg, files only), so importing this module stays light.
Each picture is a builder that returns a `Figure` (`frontier_figure`; tests/test_plots.py checks
them without writing files) and a `plot_*` that writes it. A PNG is written beside its
destination and renamed into place: a reader never sees half a PNG.

The pictures share three rules: an axis of steps has integer ticks (`step_axis`), every line
style has a legend entry, and no two texts overlap: the figure is laid out first
(`freeze_layout`), then point labels go where they cover no other text, marker or arrow
(`place_labels`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.atomic import atomic_file
from jaxpi.stats.levels import Summary, initials

# Offsets (points) tried for a point's label, nearest first: the four diagonals, then the sides,
# then the same farther out.
_RINGS = (7.0, 14.0, 24.0, 36.0, 52.0)
_NEAR = 24.0  # a label this close may still move on to clear an error bar
_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))


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


def new_figure(figsize: tuple[float, float]) -> Any:
    """A `Figure` with constrained layout on an Agg canvas, outside pyplot's registry (nothing to
    close; a test can draw it and read every text's extent)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def step_axis(ax: Any, steps: Sequence[int], label: str = "step (policy updates)") -> None:
    """An x axis of update counts: integer ticks only (never 0.25 of an update), and a view at
    least one step wide, so that a single step still gets its tick."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if steps:
        lo, hi = min(steps), max(steps)
        pad = max(0.5, 0.05 * (hi - lo))  # matplotlib's 5% margin, or half a step
        ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel(label)


def figure_legend(fig: Any, axes: Sequence[Any], *, ncol: int = 4) -> Any:
    """One legend below the axes for every labelled line of `axes`: each (label, style) once, so
    two runs of one name still get an entry each."""
    handles: dict[tuple, tuple[Any, str]] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault((label, *_style(handle)), (handle, label))
    if not handles:
        return None
    return fig.legend(
        [h for h, _ in handles.values()],
        [label for _, label in handles.values()],
        loc="outside lower center",
        ncol=min(ncol, len(handles)),
        fontsize="small",
    )


def _style(artist: Any) -> tuple:
    """What tells two lines apart in a legend: colour, alpha, line style, marker."""
    if not hasattr(artist, "get_linestyle") or not hasattr(artist, "get_marker"):
        return (id(artist),)
    return (str(artist.get_color()), artist.get_alpha(), artist.get_linestyle(), artist.get_marker())


def freeze_layout(fig: Any) -> Any:
    """Run the layout once and keep it (labels placed afterwards stay where they were put);
    returns the renderer that measured it."""
    fig.draw_without_rendering()  # the layout and every text's place, no pixels
    fig.set_layout_engine("none")
    return fig.canvas.get_renderer()


def place_labels(fig: Any, ax: Any, labels: Sequence[tuple[float, float, str, dict[str, Any]]]) -> None:
    """Annotate each (x, y, text, style) next to its point, inside `ax`, where it covers no other
    text of the figure and no marker or arrow of `ax`: the nearest such offset that also misses
    the error bars when one is within 24 points, else the nearest that misses the rest (over an
    error bar), else where it covers least. Call with the figure otherwise finished: the layout is
    frozen first (`freeze_layout`), as offsets are in points."""
    renderer = freeze_layout(fig)
    boxes = [t.get_window_extent(renderer) for t in visible_texts(fig)]
    boxes += [g.get_window_extent(renderer) for g in [*fig.legends, *[a.get_legend() for a in fig.axes]] if g]
    hard = _extents(boxes + _marks(ax, renderer))
    soft = _extents(_bars(ax, renderer))
    inside = ax.get_window_extent(renderer)
    for x, y, text, style in labels:
        tried = []  # (hard cost, soft cost, ring, annotation) in the order tried
        for ring, r in enumerate(_RINGS):
            for dx, dy in _DIRECTIONS:
                note = ax.annotate(
                    text,
                    (x, y),
                    textcoords="offset points",
                    xytext=(dx * r, dy * r),
                    ha={1: "left", -1: "right", 0: "center"}[dx],
                    va={1: "bottom", -1: "top", 0: "center"}[dy],
                    **style,
                )
                box = note.get_window_extent(renderer)
                cost = _covered(box, hard) + (0.0 if _within(box, inside) else 1e6)
                tried.append((cost, _covered(box, soft), ring, note))
                if cost == 0 and tried[-1][1] == 0 and r <= _NEAR:
                    break
            if tried[-1][0] == 0 and tried[-1][1] == 0 and r <= _NEAR:
                break
        free = [t for t in tried if t[0] == 0 and t[1] == 0 and _RINGS[t[2]] <= _NEAR]
        clear = [t for t in tried if t[0] == 0]
        best = free[0] if free else clear[0] if clear else min(tried, key=lambda t: t[0])
        for t in tried:
            if t is not best:
                t[3].remove()
        hard = np.vstack([hard, _extents([best[3].get_window_extent(renderer)])])


def visible_texts(fig: Any) -> list[Any]:
    """Every visible, non-empty text of the figure: titles, axis and tick labels, annotations,
    legend entries, the figure's own texts."""
    from matplotlib.text import Text

    return [
        t
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and (t.axes is None or t.axes.get_visible())
    ]


def save_png(fig: Any, path: str | os.PathLike) -> Path:
    """Write the figure as a PNG atomically, with the umask's permissions (not mkstemp's 0600)."""
    path = Path(path)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
    return path


def _marks(ax: Any, renderer: Any) -> list[Any]:
    """Window boxes of the markers of `ax`'s lines and of points along its arrows (annotations
    without text): what a label must not cover."""
    from matplotlib.transforms import Bbox

    out = []
    size = 4.0 * renderer.points_to_pixels(1.0)
    for line in ax.lines:
        if line.get_marker() in (None, "None", "", " "):
            continue
        for px, py in ax.transData.transform(line.get_xydata()):
            out.append(Bbox.from_extents(px - size, py - size, px + size, py + size))
    for child in ax.texts:
        if child.get_text() or getattr(child, "xyann", None) is None or child.arrow_patch is None:
            continue
        (x0, y0), (x1, y1) = ax.transData.transform([child.xyann, child.xy])
        for f in (0.25, 0.4, 0.55, 0.7):
            px, py = x0 + f * (x1 - x0), y0 + f * (y1 - y0)
            out.append(Bbox.from_extents(px - 2, py - 2, px + 2, py + 2))
    return out


def _bars(ax: Any, renderer: Any) -> list[Any]:
    """Small window boxes along the error bars of `ax` (its line collections), every ~4 pixels."""
    from matplotlib.collections import LineCollection
    from matplotlib.transforms import Bbox

    out = []
    for coll in ax.collections:
        if not isinstance(coll, LineCollection):
            continue
        for seg in coll.get_segments():
            (x0, y0), (x1, y1) = ax.transData.transform(seg[[0, -1]])
            n = max(2, int(max(abs(x1 - x0), abs(y1 - y0)) / 4))
            for f in (i / (n - 1) for i in range(n)):
                px, py = x0 + f * (x1 - x0), y0 + f * (y1 - y0)
                out.append(Bbox.from_extents(px - 1.5, py - 1.5, px + 1.5, py + 1.5))
    return out


def _extents(boxes: Sequence[Any]) -> np.ndarray:
    """Window boxes as rows (x0, y0, x1, y1)."""
    return np.array([[b.x0, b.y0, b.x1, b.y1] for b in boxes], float).reshape(-1, 4)


def _covered(box: Any, others: np.ndarray) -> float:
    """The area of `box` that `others` (rows x0, y0, x1, y1) cover, summed over them."""
    w = np.minimum(box.x1, others[:, 2]) - np.maximum(box.x0, others[:, 0])
    h = np.minimum(box.y1, others[:, 3]) - np.maximum(box.y0, others[:, 1])
    return float(np.sum(np.clip(w, 0, None) * np.clip(h, 0, None)))


def _within(box: Any, outer: Any) -> bool:
    return box.x0 >= outer.x0 and box.x1 <= outer.x1 and box.y0 >= outer.y0 and box.y1 <= outer.y1


def _frontier_layer(
    ax: Any, s: Summary, colour: Any, alpha: float, label: str | None
) -> list[tuple[float, float, str, dict[str, Any]]]:
    """One summary on the pass-rate / reasoning-tokens plane: points, both intervals, arrows
    L→M→X; returns the level labels for `place_labels`."""
    ini = initials(s.levels)
    pts = []
    labels = []
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
        labels.append((x.value, y.value, tag, {"color": colour, "alpha": alpha}))
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
    return labels


def frontier_figure(runs: Sequence[tuple[Summary, Summary]]) -> Any:
    """Pass rate vs mean reasoning tokens per attempt: per run its (first, last) summaries, one point
    per level with both 95% intervals and arrows L→M→X, the first faded and the last solid; the
    level labels placed clear of each other (`place_labels`), the legend beside the axes."""
    fig = new_figure((8.5, 5))
    ax = fig.subplots()
    cols = colours(len(runs))
    solid, faded = [], []
    for i, ((first, last), colour) in enumerate(zip(runs, cols, strict=True)):
        if i == 0 and first.step != last.step:
            # With several runs the first run's start is the common start, drawn once in grey.
            start_colour = "0.45" if len(runs) > 1 else colour
            faded += _frontier_layer(ax, first, start_colour, 0.4, f"start (step {first.step})")
        solid += _frontier_layer(ax, last, colour, 1.0, f"{last.run} (step {last.step})")
    if not solid + faded:
        ax.text(0.5, 0.5, "no level has an admitted attempt", ha="center", transform=ax.transAxes)
    ax.set_xlabel("mean reasoning tokens per attempt")
    ax.set_ylabel("pass rate")
    ax.set_ylim(-0.02, 1.08)  # room for the level labels above a 100% point
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="small")
    split = runs[0][1].split
    ax.set_title(f"Pass rate vs reasoning by effort level ({split}, 95% intervals)")
    place_labels(fig, ax, solid + faded)  # the solid layer's labels first: they get the nearest spots
    return fig


def plot_frontier(runs: Sequence[tuple[Summary, Summary]], path: str | os.PathLike) -> Path:
    """Write `frontier_figure(runs)` as a PNG at `path`."""
    return save_png(frontier_figure(runs), path)


def fidelity_figure(table: dict[str, Any]) -> Any:
    """Perplexity increase over the reference (%) against file size, one point per GGUF variant:
    filled with an importance matrix, hollow without; a line joins the two of each format."""
    fig = new_figure((7.0, 4.2))
    ax = fig.add_subplot()
    rows = [r for r in table["rows"] if r["format"] != table["reference"]]
    by_format: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_format.setdefault(r["format"], []).append(r)
    blue, grey = colours(2)
    for rs in by_format.values():
        if len(rs) == 2:
            xs, ys = [r["bytes"] / 1e6 for r in rs], [r["delta_pct"] for r in rs]
            ax.plot(xs, ys, color="0.75", lw=1, zorder=1)
    labels = []
    for imatrix, face, name in ((True, blue, "with importance matrix"), (False, "white", "without")):
        sel = [r for r in rows if bool(r["imatrix"]) is imatrix]
        if sel:
            ax.scatter(
                [r["bytes"] / 1e6 for r in sel], [r["delta_pct"] for r in sel], s=36, zorder=2,
                facecolors=face, edgecolors=blue, label=name,
            )  # fmt: skip
    for fmt, rs in by_format.items():
        r = max(rs, key=lambda r: bool(r["imatrix"]))
        labels.append((r["bytes"] / 1e6, r["delta_pct"], fmt, {"fontsize": 8}))
    ax.axhline(0.0, color=grey, lw=0.8, ls="--")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel(f"perplexity vs {table['reference']} (%)")
    ax.set_title(
        f"GGUF fidelity: teacher-forced perplexity on {table['heldout_windows']} held-out windows",
        fontsize=10,
    )
    if rows:
        ax.legend(loc="upper right", fontsize=8)
    place_labels(fig, ax, labels)
    return fig


def plot_fidelity(table: dict[str, Any], path: str | os.PathLike) -> Path:
    return save_png(fidelity_figure(table), path)


def _signed_pct(e: dict[str, float] | None) -> str:
    return "-" if e is None else f"{100 * e['value']:+.0f}% [{100 * e['lo']:+.0f}, {100 * e['hi']:+.0f}]"


def tool_calls_figure(comparison: dict[str, Any], name_a: str, name_b: str) -> Any:
    """Per task solved by both runs, A's mean tool calls over its successes against B's, one colour
    per level (marker area: how many tasks share the point), the line y = x (no change); the title
    holds the pooled mean change with its 95% interval (`jaxpi.stats.paired.paired_tool_calls`).
    `comparison` maps each level and "all" (pooled) to that function's result or None."""
    fig = new_figure((6.8, 5.6))
    ax = fig.add_subplot()
    levels = [lv for lv in comparison if lv != "all"]
    top = 0.0
    for level, colour in zip(levels, colours(len(levels)), strict=True):
        c = comparison[level]
        if c is None:
            continue
        points: dict[tuple[float, float], int] = {}
        for p in c["per_task"].values():
            points[(p["b"], p["a"])] = points.get((p["b"], p["a"]), 0) + 1
        xs, ys = [x for x, _ in points], [y for _, y in points]
        top = max(top, *xs, *ys)
        rel = c["relative"]
        change = "" if rel is None else f", {100 * rel['value']:+.0f}%"
        ax.scatter(
            xs, ys, s=[28 * n for n in points.values()], color=colour, alpha=0.65, edgecolors="white",
            label=f"{level} ({c['tasks']} tasks{change})",
        )  # fmt: skip
    top = max(top, 1.0) * 1.08
    ax.plot([0, top], [0, top], color="0.45", ls="--", lw=1, label="no change (y = x)")
    ax.set_xlim(-0.04 * top, top)  # a task with no call sits on the axis, not under it
    ax.set_ylim(-0.04 * top, top)
    ax.set_aspect("equal")
    ax.set_xlabel(f"{name_b}: tool calls per solved attempt (mean over the task's successes)")
    ax.set_ylabel(f"{name_a}: tool calls per solved attempt")
    ax.grid(alpha=0.3)
    pooled = comparison.get("all")
    if pooled is None:
        sub = "no task solved by both"
    else:
        d = pooled["difference"]
        sub = (
            f"all levels: {_signed_pct(pooled['relative'])} over {pooled['tasks']} tasks, "
            f"{d['value']:+.2f} calls [{d['lo']:+.2f}, {d['hi']:+.2f}] (95%)"
        )
    ax.set_title(f"Tool calls on the tasks both solve: {name_a} vs {name_b}\n{sub}", fontsize=10)
    ax.legend(loc="upper left", fontsize="small", title="marker area: tasks", title_fontsize="small")
    return fig


def plot_tool_calls(comparison: dict[str, Any], name_a: str, name_b: str, path: str | os.PathLike) -> Path:
    """Write `tool_calls_figure(...)` as a PNG at `path`."""
    return save_png(tool_calls_figure(comparison, name_a, name_b), path)
