"""The tables and the picture of a `jaxpi study`: per-seed ratios and pass rates, the summary
across seeds with the paired rows, the criteria, and `ordering.png` (T_L/T_M of the training
collections against update, every seed thin, the mean thick, the held-out start and end as points
with their across-seed intervals).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.experiments.toy.study_config import ARMS
from jaxpi.experiments.toy.study_stats import PAIRS, difference, point_value
from jaxpi.stats.plots import pyplot, save_png, step_axis
from jaxpi.stats.table import markdown_table


def _r(e: dict[str, float] | None, interval: bool = True) -> str:
    if e is None:
        return "–"
    text = f"{e['value']:.2f}"
    if interval and math.isfinite(e["lo"]) and math.isfinite(e["hi"]):
        text += f" [{e['lo']:.2f}, {e['hi']:.2f}]"
    return text


def _pcts(point: dict[str, Any] | None, what: str, levels: Sequence[str]) -> str:
    if point is None:
        return "–"
    vals = [point[what].get(level) for level in levels]
    return " / ".join("–" if v is None else f"{100 * v['value']:.0f}" for v in vals)


def tables(
    seeds: Sequence[dict[str, Any]], agg: dict[str, Any], arms: Sequence[str], levels: Sequence[str]
) -> str:
    """Per-seed tables (ratios, pass rates) and the across-seed summary, in Markdown."""
    ini = "/".join(lv[0].upper() for lv in levels)
    header = ["seed", "start T_L/T_M"] + [f"{ARMS[a]} T_L/T_M" for a in arms]
    if set(ARMS) <= set(arms):
        header.append("EO − binary")
    header += ["start T_M/T_X"] + [f"{ARMS[a]} T_M/T_X" for a in arms]
    body = []
    for s in seeds:
        ends = [s["arms"].get(a, {}).get("end") for a in arms]
        row = [str(s["seed"]), _r(s["start"]["ordering"]["low/medium"])]
        row += ["–" if e is None else _r(e["ordering"]["low/medium"]) for e in ends]
        if set(ARMS) <= set(arms):
            a, b = (s["arms"].get(x, {}).get("end") for x in ("effort_ordered", "binary"))
            d = difference(point_value(a, "ordering", "low/medium"), point_value(b, "ordering", "low/medium"))
            row.append("–" if d is None else f"{d:+.2f}")
        row += [_r(s["start"]["ordering"]["medium/xhigh"])]
        row += ["–" if e is None else _r(e["ordering"]["medium/xhigh"]) for e in ends]
        body.append(row)
    per_seed = markdown_table(header, body)

    header = ["seed", f"start pass {ini}", f"start sched {ini}"]
    for a in arms:
        header += [f"{ARMS[a]} pass", f"{ARMS[a]} sched"]
    header += [f"{ARMS[a]} T {ini}" for a in arms]
    body = []
    for s in seeds:
        row = [str(s["seed"]), _pcts(s["start"], "pass", levels), _pcts(s["start"], "sched", levels)]
        for a in arms:
            e = s["arms"].get(a, {}).get("end")
            row += [_pcts(e, "pass", levels), _pcts(e, "sched", levels)]
        for a in arms:
            e = s["arms"].get(a, {}).get("end")
            row.append(
                "–"
                if e is None
                else " / ".join(
                    f"{point_value(e, 'T', lv):.0f}" if point_value(e, "T", lv) is not None else "–"
                    for lv in levels
                )
            )
        body.append(row)
    rates = markdown_table(header, body)

    rows = agg["rows"]
    names = [("start", "start")] + [(a, ARMS[a]) for a in arms]
    header = ["across seeds (mean [95% t])", "n", "T_L/T_M", "T_M/T_X"]
    header += [f"pass {lv[0].upper()}" for lv in levels] + [f"sched {lv[0].upper()}" for lv in levels]
    body = []
    for key, label in names:
        n = rows[f"{key} low/medium"]["n"]
        row = [label, str(n)] + [_r(rows[f"{key} {p}"]["mean"]) for p in PAIRS]
        for what in ("pass", "sched"):
            for lv in levels:
                e = rows[f"{key} {what} {lv}"]["mean"]
                row.append(
                    "–"
                    if e is None
                    else f"{100 * e['value']:.0f}"
                    # A mean of proportions lies in [0, 1]; so does its interval, shown clipped.
                    + (
                        f" [{100 * max(e['lo'], 0.0):.0f}, {100 * min(e['hi'], 1.0):.0f}]"
                        if math.isfinite(e["lo"])
                        else ""
                    )
                )
        body.append(row)
    diffs = [(f"{a} - start", f"{ARMS[a]} − start") for a in arms]
    if set(ARMS) <= set(arms):
        diffs.append(("effort_ordered - binary", "effort-ordered − binary"))
    for key, label in diffs:
        row = [f"{label} (paired)", str(rows[f"{key} low/medium"]["n"])]
        row += [_r(rows[f"{key} {p}"]["mean"]) for p in PAIRS] + [""] * (2 * len(levels))
        body.append(row)
    summary = markdown_table(header, body)

    crit = "\n".join(f"- [{'x' if c['met'] else ' '}] {c['name']}: {c['value']}" for c in agg["criteria"])
    notes = (
        "Held-out evaluation before the first update (start) and after the last. Per seed: ratios "
        "[95% bootstrap over tasks]; pass rates over admitted / scheduled attempts, in % per level "
        f"({ini}). Across seeds: the mean over seeds [95% t-interval, n − 1 degrees of freedom; "
        "pass rates clipped to 0-100]; "
        "paired rows are the mean of per-seed differences (same start, same seed)."
    )
    return "\n\n".join(x for x in (per_seed, rates, summary, notes, crit) if x)


def plot_study(
    seeds: Sequence[dict[str, Any]], arms: Sequence[str], path: Path, rows: dict[str, Any]
) -> Path:
    """T_L/T_M against update: one panel per arm, the training collections of every seed thin,
    their mean over seeds thick, the held-out start and end as points with their t-intervals."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(arms), figsize=(6 * len(arms), 4.2), sharey=True, squeeze=False)
    colours = {"effort_ordered": "tab:blue", "binary": "tab:orange"}
    for ax, arm in zip(axes[0], arms, strict=True):
        c = colours[arm]
        curves = {}
        for s in seeds:
            series = s["arms"].get(arm, {}).get("series")
            if not series:
                continue
            x = [p[0] for p in series if p[1] is not None]
            y = [p[1] for p in series if p[1] is not None]
            ax.plot(
                x, y, "-", color=c, lw=0.8, alpha=0.45, label=None if curves else "one seed's collections"
            )
            curves[s["seed"]] = dict(series)
        steps = sorted({x for cur in curves.values() for x in cur})
        if steps:
            # A collection where no seed has a ratio (a level with no admitted success) is a gap.
            at = [[cur[x] for cur in curves.values() if cur.get(x) is not None] for x in steps]
            mean = [float(np.mean(v)) if v else math.nan for v in at]
            ax.plot(
                steps, mean, "-", color=c, lw=2.8, label=f"training collections, mean of {len(curves)} seeds"
            )
            for key, x, marker in (("start", 0, "s"), (arm, steps[-1] + 1, "D")):
                e = rows[f"{key} low/medium"]["mean"]
                if e is None:
                    continue
                err = [[e["value"] - e["lo"]], [e["hi"] - e["value"]]] if math.isfinite(e["lo"]) else None
                ax.errorbar(
                    x,
                    e["value"],
                    yerr=err,
                    fmt=marker,
                    color="k" if key == "start" else c,
                    ms=7,
                    capsize=4,
                    label=("held-out start" if key == "start" else "held-out end") + " [95% t over seeds]",
                )
        ax.axhline(1.0, color="k", ls="--", lw=1, label="T_L = T_M (no ordering)")
        ax.set_title(f"{ARMS[arm]} GRPO ({len(curves)} seeds)")
        # Integer ticks over every point drawn: the held-out start at 0, the end after the last.
        step_axis(ax, [0, *(x + 1 for x in steps[-1:])], "policy updates")
        ax.grid(alpha=0.3)
        if curves:
            # Below the panel: inside, it would cover the seeds' points or the end's interval.
            ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    axes[0, 0].set_ylabel("T_L/T_M (above 1: low reasons longer)")
    try:
        return save_png(fig, path)
    finally:
        plt.close(fig)
