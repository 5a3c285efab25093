"""Agent evaluation: the per-level table, paired comparisons, ranking, saved results, and `jaxpi eval`
end to end (serve + gateway started by the command, real Pi attempts in the sandbox, the verifier).

The statistics are checked on hand-made attempt records against their definitions; the command
runs once on an untrained tiny model (its attempt fails, which the table must show) and compares
itself with a saved evaluation in which the same task passed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxpi.eval.run import compare, load_results, rank, results_object, save_results
from jaxpi.eval.stats import level_table, overall_pass_rate, paired_difference, table_text
from jaxpi.rl.report import wilson_interval


def rec(task: str, level: str, success: bool, admitted: bool = True, **kw) -> dict:
    r = {
        "attempt_id": f"{task}-{level}-{kw.pop('i', 0)}",
        "task_id": task,
        "level": level,
        "admitted": admitted,
        "success": success and admitted,
        "reason": None if admitted else kw.pop("reason", "timeout"),
        "finish": "answer" if admitted else None,
        "turns": kw.pop("turns", 2),
        "output_tokens": kw.pop("output_tokens", 50),
        "reasoning_tokens": kw.pop("reasoning_tokens", 20),
        "wall_seconds": kw.pop("wall_seconds", 3.0),
    }
    assert not kw
    return r


def test_level_table_matches_its_definitions():
    records = [
        rec("a", "low", True, reasoning_tokens=10, wall_seconds=2.0),
        rec("b", "low", False, reasoning_tokens=30, wall_seconds=4.0),
        rec("c", "low", False, admitted=False, reason="upstream_error"),
        rec("a", "xhigh", True, reasoning_tokens=100, turns=4),
        rec("b", "xhigh", True, reasoning_tokens=300, turns=2),
    ]
    t = level_table(records, ["low", "xhigh"])
    low, xhigh = t["low"], t["xhigh"]
    # Pass rate over admitted attempts only, with the Wilson interval of 1/2.
    assert (low["attempts"], low["admitted"], low["successes"]) == (3, 2, 1)
    lo, hi = wilson_interval(1, 2)
    assert low["pass_rate"] == pytest.approx({"value": 0.5, "lo": lo, "hi": hi})
    assert low["reasoning_tokens"]["value"] == 20.0 and low["wall_seconds"] == 3.0
    assert low["not_admitted"] == {"upstream_error": 1}
    assert xhigh["pass_rate"]["value"] == 1.0 and xhigh["pass_rate"]["hi"] == 1.0 and xhigh["turns"] == 3.0
    # The bootstrap interval of mean reasoning tokens contains the mean and spans the task spread.
    r = xhigh["reasoning_tokens"]
    assert r["lo"] <= 200.0 <= r["hi"] and r["lo"] >= 100 and r["hi"] <= 300
    text = table_text(t, "demo")
    assert "50% [" in text and "upstream_error 1" in text and text.splitlines()[0] == "demo"
    o = overall_pass_rate(records)
    assert o["n"] == 4 and o["value"] == 0.75


def test_paired_difference_over_shared_tasks():
    a = [rec(t, "low", True) for t in "abcdef"]
    b = [rec(t, "low", False) for t in "abcdef"] + [rec("only-b", "low", True)]
    d = paired_difference(a, b, "low")
    assert d["tasks"] == 6 and d["value"] == d["lo"] == d["hi"] == 1.0  # every task differs by +1
    # Mixed: per-task differences +1, 0, -1, 0; the interval is a bootstrap over those four.
    a = [rec("a", "low", True), rec("b", "low", True), rec("c", "low", False), rec("d", "low", False)]
    b = [rec("a", "low", False), rec("b", "low", True), rec("c", "low", True), rec("d", "low", False)]
    d = paired_difference(a, b, "low")
    assert d["per_task"] == {"a": 1.0, "b": 0.0, "c": -1.0, "d": 0.0}
    assert d["value"] == 0.0 and -1.0 <= d["lo"] < 0.0 < d["hi"] <= 1.0
    # Levels pooled: a task's pass rate is over all its admitted attempts.
    a2 = [rec("a", "low", True), rec("a", "xhigh", False, i=1)]
    assert paired_difference(a2, [rec("a", "low", False)], None)["value"] == 0.5
    assert paired_difference(a, [rec("z", "low", True)], "low") is None


def test_results_save_load_compare_and_rank(tmp_path):
    levels = ["low", "xhigh"]
    good = results_object([rec(t, lv, True) for t in "abc" for lv in levels], levels, name="good", meta={})
    bad = results_object([rec(t, lv, t == "a") for t in "abc" for lv in levels], levels, name="bad", meta={})
    paths = save_results(good, tmp_path / "good")
    save_results(bad, tmp_path / "bad")
    assert paths["png"].stat().st_size > 1000 and (tmp_path / "good" / "table.txt").read_text().startswith(
        "good"
    )
    assert not [p for p in (tmp_path / "good").iterdir() if p.name.startswith(".")]  # no temp files left
    back = load_results(tmp_path / "good")
    assert back["table"] == json.loads(json.dumps(good["table"])) and back["name"] == "good"
    cmp = compare(back, load_results(tmp_path / "bad" / "results.json"), tmp_path)
    assert cmp["differences"]["all"]["value"] == pytest.approx(2 / 3)
    assert (tmp_path / "compare.png").is_file() and (tmp_path / "compare.json").is_file()
    assert [r["name"] for r in rank([bad, good])] == ["good", "bad"]
    (tmp_path / "broken.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match=r"broken\.json: missing 'levels'"):
        load_results(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError, match=r"no results\.json"):
        load_results(tmp_path)


def test_select_ranks_saved_evaluations(tmp_path, capsys):
    from jaxpi.cli import main

    for name, wins in (("ckpt-a", "a"), ("ckpt-b", "ab")):
        records = [rec(t, "low", t in wins) for t in "abc"]
        save_results(results_object(records, ["low"], name=name, meta={}), tmp_path / name)
    tasks = Path(__file__).resolve().parents[1] / "tasks" / "basic"
    assert (
        main(["select", str(tmp_path / "ckpt-a"), str(tmp_path / "ckpt-b"), "--tasks", str(tasks), "--json"])
        == 0
    )
    ranking = json.loads(capsys.readouterr().out)["ranking"]
    assert [r["name"] for r in ranking] == ["ckpt-b", "ckpt-a"]
    assert ranking[0]["pass_rate"]["value"] == pytest.approx(2 / 3)


# ---- `jaxpi eval` end to end ------------------------------------------------------------------------


def _ready() -> bool:
    from jaxpi.runner.install import find_pi
    from jaxpi.sandbox import bwrap_path

    try:
        find_pi()
    except FileNotFoundError:
        return False
    return bwrap_path() is not None


@pytest.mark.skipif(not _ready(), reason="needs bubblewrap and Pi (`make pi`)")
def test_jaxpi_eval_serves_runs_pi_and_writes_table_json_png(tmp_path, capsys):
    from test_pi_runner import write_task

    from jaxpi.cli import main
    from jaxpi.envs.toy_sft import make_toy_base

    base = make_toy_base(tmp_path / "base", seed=0, layers=2, attention_every=2)
    tasks = write_task(tmp_path / "tasks").parent
    # A saved evaluation in which the task passed, to compare against.
    save_results(
        results_object([rec("hello-file", "low", True)], ["low"], name="oracle", meta={}), tmp_path / "oracle"
    )
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(base), "--tasks", str(tasks), "--levels", "low", "--attempts", "1"]
    argv += ["--max-len", "2048", "--max-new-tokens", "8", "--tools", "bash", "--temperature", "0"]
    argv += ["--out", str(out), "--compare", str(tmp_path / "oracle"), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    low = report["table"]["low"]
    # The untrained model answers 8 tokens of noise: an admitted attempt that fails its verifier.
    assert (low["attempts"], low["admitted"], low["successes"]) == (1, 1, 0)
    assert low["pass_rate"]["value"] == 0.0 and low["pass_rate"]["hi"] > 0.5  # Wilson at 0/1
    assert low["output_tokens"] == 8 and low["turns"] == 1 and low["wall_seconds"] > 0
    res = json.loads((out / "results.json").read_text())
    (r,) = res["records"]
    assert r["task_id"] == "hello-file" and r["verifier_returncode"] != 0 and r["reason"] is None
    assert Path(r["session_path"]).is_file() and (out / "frontier.png").stat().st_size > 1000
    assert (out / "table.txt").read_text().splitlines()[0].startswith("base: 1 attempts")
    assert report["compare"]["differences"]["low"]["value"] == -1.0
    assert (out / "compare.png").is_file()
    assert np.isfinite(report["overall"]["hi"])
