"""One agent evaluation: every task × level × K real Pi attempts, the table, results.json, the PNG.

    OUT/results.json    the records of every attempt, the per-level table, the overall pass rate
    OUT/table.txt       the table as printed
    OUT/frontier.png    pass rate vs mean reasoning tokens, one point per level, arrows L→M→X
    with --compare:
    OUT/compare.json    paired pass-rate differences and tool-call changes, per level and pooled
    OUT/compare.png     both frontiers
    OUT/tool_calls.png  per task both solve: A's tool calls against B's, the line y = x
    OUT/attempts/<id>/  each attempt's session.jsonl, events.jsonl, verifier.txt, record.json

Written atomically (temp file + rename), so a killed run never leaves a half-written results.json.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxpi import atomic
from jaxpi.eval.stats import (
    as_report_attempts,
    compare_text,
    level_table,
    overall_pass_rate,
    summary,
    table_text,
    tool_calls_text,
)
from jaxpi.runner.attempt import KeyFn, RunnerConfig, TraceFn, run_attempts
from jaxpi.runner.record import AttemptRecord
from jaxpi.stats.paired import paired_difference, paired_tool_calls
from jaxpi.stats.plots import plot_frontier, plot_tool_calls
from jaxpi.tasks.task import Task

RESULTS = "results.json"


def write_atomic(path: Path, text: str) -> Path:
    # the umask's permissions, not mkstemp's 0600; a leftover of a killed run is cleaned
    return atomic.write_text(path, text)


class Progress:
    """A one-line progress bar on stderr (or nothing)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.passed, self.enabled, self.t0 = total, 0, 0, enabled, time.time()

    def __call__(self, rec: AttemptRecord) -> None:
        self.done += 1
        self.passed += rec.success
        if not self.enabled:
            return
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        print(
            f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} attempts, "
            f"{self.passed} passed, {time.time() - self.t0:.0f}s",
            end="" if self.done < self.total else "\n",
            file=sys.stderr,
            flush=True,
        )


def attempt_jobs(
    tasks: Sequence[Task], levels: Sequence[str], k: int, prefix: str
) -> list[tuple[Task, str, str]]:
    """(task, level, attempt id) for every task × level × k; ids are unique within the evaluation."""
    return [(t, lv, f"{prefix}-{t.id}-{lv}-{i}") for t in tasks for lv in levels for i in range(k)]


def evaluate(
    tasks: Sequence[Task],
    levels: Sequence[str],
    attempts: int,
    endpoint_url: str,
    out_dir: str | Path,
    *,
    name: str,
    runner_cfg: RunnerConfig | None = None,
    trace: TraceFn | None = None,
    key: KeyFn | None = None,
    meta: dict[str, Any] | None = None,
    progress: bool = True,
    on_record: Callable[[AttemptRecord], Any] | None = None,
) -> dict[str, Any]:
    """Run the evaluation against `endpoint_url`; returns (and writes) the results object."""
    if attempts < 1 or not levels or not tasks:
        raise ValueError(
            f"need tasks, levels and attempts >= 1 (got {len(tasks)}, {list(levels)}, {attempts})"
        )
    out = Path(out_dir)
    # A time prefix: evaluations sharing one long-lived gateway must not share attempt keys.
    jobs = attempt_jobs(tasks, levels, attempts, prefix=f"ev{int(time.time() * 1000) % 10**9:09d}")
    bar = Progress(len(jobs), progress)

    def tick(rec: AttemptRecord) -> None:
        bar(rec)
        if on_record is not None:
            on_record(rec)

    t0 = time.time()
    recs = run_attempts(
        jobs, endpoint_url, out / "attempts", cfg=runner_cfg, trace=trace, key=key, progress=tick
    )
    records = [r.to_json() for r in recs]
    results = results_object(
        records, levels, name=name, meta={**(meta or {}), "wall_seconds": time.time() - t0}
    )
    save_results(results, out)
    return results


def results_object(
    records: Sequence[dict[str, Any]], levels: Sequence[str], *, name: str, meta: dict[str, Any]
) -> dict[str, Any]:
    table = level_table(records, levels)
    return {
        "name": name,
        "levels": list(levels),
        "tasks": sorted({r["task_id"] for r in records}),
        "table": table,
        "overall": overall_pass_rate(records),
        "table_text": table_text(table, f"{name}: {len(records)} attempts"),
        "meta": meta,
        "records": list(records),
    }


def save_results(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """results.json, table.txt and frontier.png into `out`."""
    paths = {
        "results": write_atomic(out / RESULTS, json.dumps(results, indent=2)),
        "table": write_atomic(out / "table.txt", results["table_text"] + "\n"),
    }
    # One summary as both "first" and "last": plot_frontier then draws a single layer of points.
    s = summary(results["records"], results["levels"], results["name"])
    paths["png"] = plot_frontier([(s, s)], out / "frontier.png")
    return paths


def load_results(path: str | Path) -> dict[str, Any]:
    """A saved evaluation: its directory or its results.json."""
    p = Path(path)
    f = p / RESULTS if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{p}: no {RESULTS} (not a saved `jaxpi eval` output)")
    try:
        obj = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e.msg} at line {e.lineno})") from None
    for key in ("name", "levels", "records"):
        if key not in obj:
            raise ValueError(f"{f}: missing {key!r} (not a `jaxpi eval` results file)")
    return obj


def compare(a: dict[str, Any], b: dict[str, Any], out: Path | None = None) -> dict[str, Any]:
    """Paired per-level (and pooled) differences of two evaluations: pass rates over the tasks both
    attempted, tool calls over the tasks both solve (A − B); the PNGs and compare.json when `out`."""
    levels = [lv for lv in a["levels"] if lv in b["levels"]]
    if not levels:
        raise ValueError(f"{a['name']} and {b['name']} share no effort level")
    diffs = {lv: paired_difference(a["records"], b["records"], lv) for lv in levels}
    diffs["all"] = paired_difference(a["records"], b["records"], None)
    ta, tb = as_report_attempts(a["records"]), as_report_attempts(b["records"])
    tools = {lv: paired_tool_calls(ta, tb, lv) for lv in [*levels, None]}
    tools = {("all" if lv is None else lv): c for lv, c in tools.items()}
    result = {"a": a["name"], "b": b["name"], "levels": levels, "differences": diffs, "tool_calls": tools}
    result["text"] = (
        compare_text(diffs, a["name"], b["name"]) + "\n\n" + tool_calls_text(tools, a["name"], b["name"])
    )
    if out is not None:
        sa, sb = summary(a["records"], levels, a["name"]), summary(b["records"], levels, b["name"])
        plot_frontier([(sa, sa), (sb, sb)], out / "compare.png")
        plot_tool_calls(tools, a["name"], b["name"], out / "tool_calls.png")
        write_atomic(out / "compare.json", json.dumps(result, indent=2))
    return result


def rank(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checkpoints by pooled agent pass rate (highest first; ties by the interval's lower end)."""
    rows = []
    for r in results:
        o = r.get("overall") or overall_pass_rate(r["records"])
        rows.append(
            {
                "name": r["name"],
                "pass_rate": o,
                "per_level": {lv: r["table"][lv]["pass_rate"] for lv in r["levels"]},
            }
        )
    return sorted(
        rows, key=lambda x: (-(x["pass_rate"] or {}).get("value", -1), -(x["pass_rate"] or {}).get("lo", -1))
    )
