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
from hypothesis import given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi.eval.run import compare, load_results, rank, results_object, save_results
from jaxpi.eval.stats import as_report_attempts, level_table, overall_pass_rate, table_text
from jaxpi.stats.intervals import wilson_interval
from jaxpi.stats.paired import paired_difference, paired_tool_calls


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
    if "tools" in kw:  # by tool name; records written before the counts existed have neither key
        r["tool_calls"] = kw.pop("tools")
        r["model_calls"] = kw.pop("model_calls", r["turns"])
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


# ---- tool calls: the table's columns, the paired change on the tasks both solve -----------------


def test_level_table_tool_and_model_calls():
    records = [
        rec("a", "low", True, tools={"bash": 3, "read": 1}, model_calls=5),
        rec("b", "low", False, tools={"bash": 1}, model_calls=2),
        rec("c", "low", False, admitted=False, tools={"bash": 40}, model_calls=40),  # not admitted
    ]
    low = level_table(records, ["low"])["low"]
    # Per admitted attempt: (4 + 1) / 2 in all; a tool an attempt did not call counts 0 for it.
    assert low["tool_calls"] == 2.5 and low["tool_calls_by_tool"] == {"bash": 2.0, "read": 0.5}
    assert low["model_calls"] == 3.5
    row = table_text({"low": low}, "t").splitlines()
    assert "tool calls" in row[1] and "model calls" in row[1] and "  2.5  " in row[2] and "  3.5  " in row[2]
    # Without the counts (a record saved before they existed), they are unknown, not zero.
    old = level_table([rec("a", "low", True), rec("b", "low", True, tools={"bash": 1})], ["low"])["low"]
    assert old["tool_calls"] is old["tool_calls_by_tool"] is old["model_calls"] is None
    assert table_text({"low": old}, "t").splitlines()[2].split()[-4:-2] == ["-", "-"]


def solved(task: str, calls: int | None, level: str = "low", i: int = 0, ok: bool = True) -> dict:
    return {"task_id": task, "level": level, "admitted": True, "success": ok, "tool_calls": calls, "i": i}


def test_paired_tool_calls_by_hand():
    a = [
        solved("a", 2),
        solved("a", 4, i=1),
        solved("a", 0, ok=False),
        solved("b", 1),
        solved("c", 1, ok=False),
    ]
    a += [solved("e", 2), solved("f", None)]
    b = [solved("a", 6), solved("b", 2), solved("c", 5), solved("d", 3), solved("e", 0), solved("f", 4)]
    c = paired_tool_calls(a, b, "low")
    # Paired: a (A 3 = mean of 2 and 4, B 6), b (1, 2), e (2, 0). Not c (A failed), d (A never
    # tried), f (A's success has no count).
    assert c["per_task"] == {"a": {"a": 3.0, "b": 6.0}, "b": {"a": 1.0, "b": 2.0}, "e": {"a": 2.0, "b": 0.0}}
    assert c["tasks"] == 3 and c["difference"]["value"] == pytest.approx((-3 - 1 + 2) / 3)
    assert (c["mean_a"], c["mean_b"]) == (2.0, pytest.approx(8 / 3))
    # Relative over a and b only (B made no call on e): both −50%, so the interval is the point.
    assert c["relative_tasks"] == 2 and c["relative"] == {"value": -0.5, "lo": -0.5, "hi": -0.5}
    d = c["difference"]
    assert -3.0 <= d["lo"] < d["value"] < d["hi"] <= 2.0
    assert paired_tool_calls(a, b, "xhigh") is None  # nothing at that level
    # Levels pooled: a task's mean is over its successes at every level.
    pooled = paired_tool_calls([solved("a", 2), solved("a", 6, "xhigh")], [solved("a", 8, "medium")], None)
    assert pooled["per_task"] == {"a": {"a": 4.0, "b": 8.0}} and pooled["relative"]["value"] == -0.5


ATTEMPTS = st.lists(
    st.builds(
        solved,
        st.sampled_from("abcdef"),
        st.none() | st.integers(0, 9),
        st.sampled_from(["low", "xhigh"]),
        st.integers(0, 3),
        st.booleans(),
    ),
    max_size=30,
)


@fixed_seed(3)
@settings(max_examples=150, deadline=None)
@given(a=ATTEMPTS, b=ATTEMPTS, extra=ATTEMPTS, level=st.sampled_from(["low", None]))
def test_paired_tool_calls_swap_and_unshared_tasks(a, b, extra, level):
    ab, ba = paired_tool_calls(a, b, level), paired_tool_calls(b, a, level)
    assert (ab is None) == (ba is None)
    if ab is not None:
        # Swapping the runs negates the absolute difference and every task's pair.
        assert ba["difference"]["value"] == pytest.approx(-ab["difference"]["value"])
        assert ba["per_task"] == {t: {"a": p["b"], "b": p["a"]} for t, p in ab["per_task"].items()}
        assert ab["relative_tasks"] <= ab["tasks"] == len(ab["per_task"])
    # Attempts that solve nothing B solved (failures, no count, tasks B never solved) change nothing.
    b_solved = {r["task_id"] for r in b if r["success"] and r["tool_calls"] is not None}
    noise = [r for r in extra if not r["success"] or r["tool_calls"] is None or r["task_id"] not in b_solved]
    assert paired_tool_calls(a + noise, b, level) == ab


def test_compare_reports_tool_calls_and_draws_them(tmp_path):
    levels = ["low", "xhigh"]
    a = [rec(t, lv, True, tools={"bash": 2}) for t in "abc" for lv in levels]
    b = [rec(t, lv, t != "c", tools={"bash": 3, "read": 1}) for t in "abc" for lv in levels]
    ra = results_object(a, levels, name="lean", meta={})
    rb = results_object(b, levels, name="base", meta={})
    cmp = compare(ra, rb, tmp_path)
    low = cmp["tool_calls"]["low"]
    assert low["tasks"] == 2 and low["relative"]["value"] == -0.5 and low["difference"]["value"] == -2.0
    text = cmp["text"].splitlines()
    assert "tool calls on the tasks both solve, lean vs base" in text[5]
    assert text[6] == (
        "  low      -50% [-50, -50] (2 tasks); -2.00 calls [-2.00, -2.00]; lean 2.00, base 4.00 per solved attempt"
    )
    assert (tmp_path / "tool_calls.png").stat().st_size > 1000
    assert json.loads((tmp_path / "compare.json").read_text())["tool_calls"]["all"]["tasks"] == 2


def test_results_without_tool_counts_still_load_and_compare(tmp_path):
    """results.json of an evaluation saved before tool and model calls were counted: its records
    and table lack the keys. It loads, prints and compares; its counts are unknown, never zero."""
    levels = ["low"]
    old = results_object([rec(t, "low", True) for t in "ab"], levels, name="old", meta={})
    for lv in old["table"].values():
        for key in ("tool_calls", "tool_calls_by_tool", "model_calls"):
            del lv[key]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(json.dumps(old))
    back = load_results(tmp_path / "old")
    assert "tool_calls" not in back["records"][0] and table_text(back["table"], "old")
    assert as_report_attempts(back["records"])[0]["tool_calls"] is None
    new = results_object([rec(t, "low", True, tools={"bash": 1}) for t in "ab"], levels, name="new", meta={})
    for x, y in ((new, back), (back, new), (back, back)):
        cmp = compare(x, y, tmp_path)
        assert cmp["differences"]["low"]["tasks"] == 2  # pass rates compare as before
        assert cmp["tool_calls"] == {"low": None, "all": None}
        assert "low      no task solved by both" in cmp["text"]
