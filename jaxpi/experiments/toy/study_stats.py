"""The numbers of a `jaxpi study`: per seed, the start's and each arm's end (held-out evaluation:
T_L/T_M, T_M/T_X with their 95% task bootstrap, per-level pass rates over admitted and over
scheduled attempts with 95% Wilson); across seeds the mean of each with a 95% t-interval over seeds
(the seeds are the independent replicates; n - 1 degrees of freedom), the paired differences
effort-ordered − binary and end − start (same start, same seed) with their t-intervals, and the
criteria for "it holds" checked.

The start is the step-0 evaluation, which both arms run on the same policy with the same seed;
`read_seed` checks that the two are identical.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpi.experiments.toy.study_config import ARMS
from jaxpi.rl.runs import Run, load_run, step_series, summarize
from jaxpi.stats.intervals import Estimate, estimate_json, t_interval
from jaxpi.stats.levels import Summary

CRITERIA_SHARE = 0.8  # effort-ordered below 1.0 in at least this share of seeds (4 of 5)


# ---- reading the runs ----------------------------------------------------------------------------
PAIRS = ("low/medium", "medium/xhigh")


def _point(summary: Summary) -> dict[str, Any]:
    """The numbers of one held-out evaluation that the study compares."""
    out: dict[str, Any] = {"step": summary.step, "ordering": {}, "pass": {}, "sched": {}, "T": {}}
    for pair in PAIRS:
        out["ordering"][pair] = estimate_json(summary.ordering.get(pair))
    for level, s in summary.stats.items():
        out["pass"][level] = estimate_json(s.pass_rate)
        out["sched"][level] = estimate_json(s.pass_rate_scheduled)
        out["T"][level] = None if s.reasoning_tokens is None else s.reasoning_tokens.value
        out.setdefault("n", {})[level] = {"admitted": s.admitted, "scheduled": s.scheduled}
    return out


# What an arm's reward makes of an attempt: the policy's samples are the same in both arms, these not.
_SCORING = ("reward", "advantage")


def eval_records(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The evaluation's attempts at `step` as the policy sampled them (the arm's scores left out)."""
    recs = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines() if x.strip()]
    return [
        {k: v for k, v in r.items() if k not in _SCORING}
        for r in recs
        if r["split"] == "eval" and r["step"] == step
    ]


def _train_series(run: Run) -> list[tuple[int, float | None]]:
    """T_L/T_M of every training collection: (updates before it, ratio)."""
    return [(s.step, est_value(s.ordering.get("low/medium"))) for s in step_series(run, "train", n_boot=1)]


def est_value(e: Estimate | None) -> float | None:
    """An estimate's value, None for none."""
    return None if e is None else e.value


def read_seed(root: Path, k: int, arms: Sequence[str], sft_root: Path | None = None) -> dict[str, Any] | None:
    """One seed's start and per-arm ends (None when no arm of it has finished)."""
    out: dict[str, Any] = {"seed": k, "arms": {}}
    starts = []
    for arm in arms:
        run_dir = root / f"seed-{k}" / ARMS[arm]
        if not (run_dir / "done.json").exists():
            continue
        run = load_run(run_dir)
        first, last = summarize(run, "eval", "first"), summarize(run, "eval", "last")
        starts.append((arm, run_dir, first))
        done = json.loads((run_dir / "done.json").read_text())
        out["arms"][arm] = {
            "dir": str(run_dir),
            "end": _point(last),
            "series": _train_series(run),
            "seconds": done["seconds"],
        }
    if not starts:
        return None
    _, dir0, first = starts[0]
    out["start"] = _point(first)
    # Both arms evaluate the same policy with the same seed before their first update.
    ref = eval_records(dir0, first.step)
    out["start_identical"] = all(eval_records(d, s.step) == ref for _, d, s in starts[1:])
    sft_done = (sft_root or root) / f"seed-{k}" / "sft" / "done.json"
    if sft_done.exists():
        out["sft_seconds"] = json.loads(sft_done.read_text())["seconds"]
    return out


# ---- across seeds --------------------------------------------------------------------------------
def point_value(point: dict[str, Any] | None, what: str, key: str) -> float | None:
    """`point[what][key]`'s value (an estimate's or a plain number); None where undefined."""
    if point is None:
        return None
    v = point[what].get(key)
    return v["value"] if isinstance(v, dict) else v


def difference(a: float | None, b: float | None) -> float | None:
    """a − b, None where either is undefined."""
    return None if a is None or b is None else a - b


def pass_rate_drops(seed: dict[str, Any], arm: str) -> list[str]:
    """Levels whose end pass rate (admitted or scheduled) is below the start's 95% Wilson interval."""
    start, end = seed["start"], seed["arms"][arm]["end"]
    out = []
    for what in ("pass", "sched"):
        for level, s in start[what].items():
            e = end[what].get(level)
            if s is not None and (e is None or e["value"] < s["lo"]):
                out.append(f"{what} {level}")
    return out


def aggregate(seeds: Sequence[dict[str, Any]], arms: Sequence[str], levels: Sequence[str]) -> dict[str, Any]:
    """Means over seeds with 95% t-intervals, the paired differences, and the criteria."""
    rows: dict[str, Any] = {}

    def add(name: str, values: Sequence[float | None]) -> None:
        rows[name] = {"mean": estimate_json(t_interval(values)), "n": sum(v is not None for v in values)}

    for pair in PAIRS:
        add(f"start {pair}", [point_value(s["start"], "ordering", pair) for s in seeds])
    for what in ("pass", "sched"):
        for level in levels:
            add(f"start {what} {level}", [point_value(s["start"], what, level) for s in seeds])
    for level in levels:
        add(f"start T {level}", [point_value(s["start"], "T", level) for s in seeds])
    for arm in arms:
        ends = [s["arms"].get(arm, {}).get("end") for s in seeds]
        for pair in PAIRS:
            add(f"{arm} {pair}", [point_value(e, "ordering", pair) for e in ends])
            add(
                f"{arm} - start {pair}",
                [
                    difference(point_value(e, "ordering", pair), point_value(s["start"], "ordering", pair))
                    for s, e in zip(seeds, ends, strict=True)
                ],
            )
        for what in ("pass", "sched"):
            for level in levels:
                add(f"{arm} {what} {level}", [point_value(e, what, level) for e in ends])
        for level in levels:
            add(f"{arm} T {level}", [point_value(e, "T", level) for e in ends])
    if set(ARMS) <= set(arms):
        for pair in PAIRS:
            diffs = []
            for s in seeds:
                a, b = (s["arms"].get(arm, {}).get("end") for arm in ("effort_ordered", "binary"))
                diffs.append(difference(point_value(a, "ordering", pair), point_value(b, "ordering", pair)))
            add(f"effort_ordered - binary {pair}", diffs)
    return {"rows": rows, "criteria": criteria(seeds, arms, rows)}


def criteria(
    seeds: Sequence[dict[str, Any]], arms: Sequence[str], rows: dict[str, Any]
) -> list[dict[str, Any]]:
    """The issue's bar for "it holds", each with its measured value and whether it is met."""
    out = []
    if "effort_ordered" not in arms:
        return out
    eo = [s for s in seeds if "effort_ordered" in s["arms"]]
    ends = [point_value(s["arms"]["effort_ordered"]["end"], "ordering", "low/medium") for s in eo]
    below = sum(v is not None and v < 1.0 for v in ends)
    need = math.ceil(CRITERIA_SHARE * len(eo))
    out.append(
        {
            "name": f"effort-ordered ends with T_L/T_M < 1.0 in at least {need} of {len(eo)} seeds",
            "value": f"{below} of {len(eo)}",
            "met": bool(eo) and below >= need,
        }
    )
    mean = rows["effort_ordered low/medium"]["mean"]
    hi = None if mean is None else mean["hi"]
    out.append(
        {
            "name": "upper 95% bound of effort-ordered's mean T_L/T_M below 1.0",
            "value": "–" if hi is None or not math.isfinite(hi) else f"{hi:.2f}",
            "met": hi is not None and math.isfinite(hi) and hi < 1.0,
        }
    )
    if "binary" in arms:
        b, s = rows["binary low/medium"]["mean"], rows["start low/medium"]["mean"]
        out.append(
            {
                "name": "binary's mean T_L/T_M not below the start's mean",
                "value": "–" if b is None or s is None else f"{b['value']:.2f} vs {s['value']:.2f}",
                "met": b is not None and s is not None and b["value"] >= s["value"],
            }
        )
    drops = {s["seed"]: pass_rate_drops(s, "effort_ordered") for s in eo}
    bad = {k: v for k, v in drops.items() if v}
    out.append(
        {
            "name": "no effort-ordered level's pass rate (admitted, scheduled) below the start's 95% Wilson interval, in any seed",
            "value": "none" if not bad else "; ".join(f"seed {k}: {', '.join(v)}" for k, v in bad.items()),
            "met": bool(eo) and not bad,
        }
    )
    return out
