"""The pictures (frontier.png, ordering.png, pass_rate.png, tool_calls.png) drawn from generated
summaries and records: no two visible texts overlap, a step axis has integer ticks, and every line
style has a legend entry.

The figures come from the builders (`frontier_figure`, `ordering_figure`, `pass_rate_figure`),
drawn on their Agg canvas; nothing is written. A few shapes by default, more under slow.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpi.rl.report_plots import ordering_figure, pass_rate_figure
from jaxpi.stats.intervals import Estimate
from jaxpi.stats.levels import LevelStats, Summary
from jaxpi.stats.paired import paired_tool_calls
from jaxpi.stats.plots import frontier_figure, tool_calls_figure

LEVEL_SETS = (
    ("low", "medium", "xhigh"),
    ("low",),
    ("low", "high"),
    ("low", "medium", "high", "xhigh"),
    ("medium", "max"),  # initials collide: the labels are the full names
)
FEW = settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def estimate(draw: Any, lo: float, hi: float, spread: float) -> Estimate:
    value = draw(st.floats(lo, hi))
    below, above = draw(st.floats(0, spread)), draw(st.floats(0, spread))
    return Estimate(value, max(lo, value - below), min(hi, value + above) if hi < 1e9 else value + above)


@st.composite
def level_stats(draw: Any, level: str) -> LevelStats:
    scheduled = draw(st.integers(1, 40))
    admitted = draw(st.integers(0, scheduled))
    if admitted == 0:
        return LevelStats(
            level, scheduled, 0, 0.0, 0, 0, None, Estimate(0.0, 0.0, 0.1), None, None, None, None
        )
    p = estimate(draw, 0.0, 1.0, 0.4)
    sched = Estimate(p.value * admitted / scheduled, p.lo * admitted / scheduled, p.hi * admitted / scheduled)
    t = estimate(draw, 5.0, draw(st.sampled_from([60.0, 3000.0, 40000.0])), 800.0)
    return LevelStats(level, scheduled, admitted, admitted / scheduled, 3, 1, p, sched, t, 10.0, 100.0, 2.0)


@st.composite
def summaries(draw: Any, name: str, levels: tuple[str, ...], step: int, split: str) -> Summary:
    stats = {lv: draw(level_stats(lv)) for lv in levels}
    ordering = {}
    for a, b in itertools.pairwise(levels):
        ta, tb = stats[a].reasoning_tokens, stats[b].reasoning_tokens
        ordering[f"{a}/{b}"] = (
            None if ta is None or tb is None else Estimate(ta.value / tb.value, ta.lo / tb.hi, ta.hi / tb.lo)
        )
    return Summary(name, split, step, step, levels, stats, ordering, tasks=3)


NAMES = ("effort-ordered seed 0", "binary seed 0", "run-b", "a much longer run name, seed 12")


@st.composite
def runs(draw: Any) -> list[list[Summary]]:
    """1-3 runs on one level set, each a series of summaries at increasing steps (1-6 of them)."""
    levels = draw(st.sampled_from(LEVEL_SETS))
    split = draw(st.sampled_from(["eval", "train"]))
    n = draw(st.integers(1, 3))
    names = draw(st.permutations(NAMES))[:n]
    out = []
    for name in names:
        steps = sorted(
            draw(st.sets(st.integers(0, draw(st.sampled_from([3, 12, 400]))), min_size=1, max_size=6))
        )
        out.append([draw(summaries(name, levels, s, split)) for s in steps])
    return out


# ---- what the pictures must hold --------------------------------------------------------------
def draw_figure(fig: Any) -> Any:
    fig.draw_without_rendering()  # the layout and every text's place, as savefig puts them
    return fig.canvas.get_renderer()


def tick_labels(axis: Any) -> list[Any]:
    """The tick labels drawn: visible, non-empty, at a tick inside the view."""
    lo, hi = sorted(axis.get_view_interval())
    eps = 1e-9 * max(1.0, abs(hi - lo))
    locs = axis.get_majorticklocs()
    labels = axis.get_majorticklabels()
    return [
        t
        for loc, t in zip(locs, labels, strict=False)
        if lo - eps <= loc <= hi + eps and t.get_visible() and t.get_text().strip()
    ]


def visible_texts(fig: Any) -> list[tuple[str, Any]]:
    """(what, Text) of every visible text: tick labels, axis labels, titles, offsets, annotations,
    legend entries, the figure's texts."""
    out = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for axis in (ax.xaxis, ax.yaxis):
            out += [("tick", t) for t in tick_labels(axis)]
            out += [("axis label", axis.label), ("offset", axis.offsetText)]
        out += [("title", t) for t in (ax.title, ax._left_title, ax._right_title)]
        out += [("annotation", t) for t in ax.texts]
        if ax.get_legend():
            out += [("legend", t) for t in ax.get_legend().get_texts()]
    for legend in fig.legends:
        out += [("legend", t) for t in legend.get_texts()]
    out += [("figure text", t) for t in fig.texts]
    return [(w, t) for w, t in out if t.get_visible() and t.get_text().strip()]


def assert_no_texts_overlap(fig: Any, renderer: Any) -> None:
    boxes = [(w, t.get_text(), t.get_window_extent(renderer)) for w, t in visible_texts(fig)]
    assert len(boxes) > 3
    for (wa, ta, a), (wb, tb, b) in itertools.combinations(boxes, 2):
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        assert w <= 0.5 or h <= 0.5, f"{wa} {ta!r} overlaps {wb} {tb!r}: {a} / {b}"


def assert_integer_steps(fig: Any) -> None:
    step_axes = [ax for ax in fig.axes if "step" in ax.get_xlabel()]
    assert step_axes
    for ax in step_axes:
        labels = [t.get_text() for t in tick_labels(ax.xaxis)]
        assert labels and all(re.fullmatch(r"[−-]?\d+", s) for s in labels), labels


def style(artist: Any) -> tuple:
    from matplotlib.colors import to_rgba

    return (to_rgba(artist.get_color(), artist.get_alpha()), artist.get_linestyle(), artist.get_marker())


def assert_every_line_style_in_a_legend(fig: Any) -> None:
    """Each line drawn (an errorbar counts as its data line, not its caps) has the style of an
    artist that a legend names."""
    from matplotlib.container import ErrorbarContainer

    legends = [*fig.legends, *[ax.get_legend() for ax in fig.axes if ax.get_legend()]]
    named = {t.get_text() for legend in legends for t in legend.get_texts()}
    covered, lines = set(), []
    for ax in fig.axes:
        caps = set()
        for c in ax.containers:
            if isinstance(c, ErrorbarContainer):
                caps |= {id(x) for x in c.lines[1]}
                if c.get_label() in named:
                    covered.add(style(c.lines[0]))
        for line in ax.lines:
            if id(line) in caps or not line.get_visible() or len(line.get_xdata()) == 0:
                continue
            lines.append(line)
            if line.get_label() in named:
                covered.add(style(line))
    for line in lines:
        assert style(line) in covered, (line.get_label(), style(line), named)


def check(fig: Any, steps: bool) -> None:
    renderer = draw_figure(fig)
    assert_every_line_style_in_a_legend(fig)
    if steps:
        assert_integer_steps(fig)
    assert_no_texts_overlap(fig, renderer)


# ---- the three pictures ---------------------------------------------------------------------------
def frontier_ends(series: list[list[Summary]]) -> list[tuple[Summary, Summary]]:
    return [(s[0], s[-1]) for s in series]


@FEW
@given(series=runs())
def test_frontier(series):
    check(frontier_figure(frontier_ends(series)), steps=False)


@FEW
@given(series=runs())
def test_ordering(series):
    check(ordering_figure(series), steps=True) if len(series[0][0].levels) > 1 else None


@FEW
@given(series=runs())
def test_pass_rate(series):
    check(pass_rate_figure(series), steps=True)


@pytest.mark.slow
@MANY
@given(series=runs())
def test_every_picture_on_many_shapes(series):
    check(frontier_figure(frontier_ends(series)), steps=False)
    if len(series[0][0].levels) > 1:
        check(ordering_figure(series), steps=True)
    check(pass_rate_figure(series), steps=True)


@st.composite
def tool_call_comparisons(draw: Any) -> tuple[dict[str, Any], str, str]:
    """Two evaluations' solved attempts with tool counts (0-60 calls), compared per level and pooled."""
    levels = draw(st.sampled_from(LEVEL_SETS))
    record = st.fixed_dictionaries(
        {
            "task_id": st.sampled_from([f"t{i}" for i in range(30)]),
            "level": st.sampled_from(levels),
            "admitted": st.just(True),
            "success": st.booleans(),
            "tool_calls": st.integers(0, draw(st.sampled_from([3, 60]))),
        }
    )
    a, b = draw(st.lists(record, max_size=80)), draw(st.lists(record, max_size=80))
    comparison = {lv: paired_tool_calls(a, b, lv) for lv in levels}
    comparison["all"] = paired_tool_calls(a, b, None)
    name_a, name_b = draw(st.permutations(NAMES))[:2]
    return comparison, name_a, name_b


@FEW
@given(case=tool_call_comparisons())
def test_tool_calls(case):
    check(tool_calls_figure(*case), steps=False)


def test_the_labels_of_coinciding_points_are_apart():
    """Two runs ending on the same points, a start on them too: six labels at three spots."""
    levels = ("low", "medium", "xhigh")
    stats = {
        lv: LevelStats(
            lv,
            8,
            8,
            1.0,
            3,
            4,
            Estimate(0.5, 0.3, 0.7),
            Estimate(0.5, 0.3, 0.7),
            Estimate(t, t - 5, t + 5),
            1.0,
            1.0,
            1.0,
        )
        for lv, t in zip(levels, (20.0, 21.0, 22.0), strict=True)
    }
    ordering = {"low/medium": Estimate(0.95, 0.9, 1.0), "medium/xhigh": Estimate(0.95, 0.9, 1.0)}
    a0, a1, b1 = (
        Summary(n, "eval", s, s, levels, stats, ordering, 3) for n, s in (("a", 0), ("a", 2), ("b", 2))
    )
    check(frontier_figure([(a0, a1), (a0, b1)]), steps=False)
    check(ordering_figure([[a0, a1], [a0, b1]]), steps=True)
    check(pass_rate_figure([[a0, a1], [a0, b1]]), steps=True)
