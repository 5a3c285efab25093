"""Agent evaluation: the per-level table, paired comparisons, ranking, saved results and `jaxpi
select`, checked on hand-made attempt records against their definitions.

`jaxpi eval` itself (serve + gateway started by the command, a real Pi attempt in the sandbox, the
verifier, the table / results.json / PNG / comparison) runs in tests/test_pi_runner.py, where its
attempt also feeds the SFT and GRPO steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxpi.eval.run import compare, load_results, rank, results_object, save_results
from jaxpi.eval.stats import level_table, overall_pass_rate, table_text
from jaxpi.stats.intervals import wilson_interval
from jaxpi.stats.paired import paired_difference


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


def test_cli_help_and_argument_errors(capsys):
    from jaxpi.cli import main

    for cmd in (["eval"], ["select"], ["pi", "setup"], ["pi", "run"]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--help"])
        assert e.value.code == 0
        assert "--json" in capsys.readouterr().out
    assert main(["eval", "--tasks", "tasks/basic", "--levels", "low"]) == 2  # bad input
    assert "jaxpi eval: error: give exactly one of --model and --endpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--model", "m", "--tasks", "tasks/basic", "--levels", "low,max"])
    assert "levels must be a comma list" in capsys.readouterr().err
