"""Task directories: the loader's errors, the audit on broken tasks, and the shipped tasks' audit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxpi.cli import main
from jaxpi.sandbox import bwrap_path
from jaxpi.tasks import (
    TaskError,
    audit_tasks,
    load_task,
    load_tasks,
    new_workspace,
    run_verifier,
    workspace_root,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "tasks"
needs_bwrap = pytest.mark.skipif(
    bwrap_path() is None, reason="bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
)

TOML = """[metadata]
id = "{id}"
category = "shell"
difficulty = "easy"
tags = ["t"]

[limits]
wall_seconds = 60
max_turns = 10
max_tokens = 4096

[verifier]
timeout = 10
"""


def make_task(
    root: Path, name: str, solve: str, test: str, env: dict[str, str] | None = None, toml: str | None = None
) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(f"Do the {name} thing.\n")
    (d / "task.toml").write_text(toml if toml is not None else TOML.format(id=name))
    (d / "tests" / "test.sh").write_text(test)
    (d / "solution" / "solve.sh").write_text(solve)
    for rel, text in (env or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    return d


GOOD = dict(solve="echo 42 > answer.txt\n", test='test "$(cat answer.txt 2>/dev/null)" = 42\n')


def test_load_a_task(tmp_path):
    d = make_task(tmp_path, "good", env={"data/x.txt": "x\n"}, **GOOD)
    t = load_task(d)
    assert (t.id, t.category, t.difficulty, t.tags) == ("good", "shell", "easy", ("t",))
    assert t.limits.wall_seconds == 60 and t.limits.max_turns == 10 and t.limits.max_tokens == 4096
    assert t.verifier_timeout == 10.0 and t.instruction == "Do the good thing.\n"
    assert t.environment_dir == d / "environment" and t.tests_dir == d / "tests"
    with workspace_root() as root:
        ws = new_workspace(t, root)
        assert (ws / "data" / "x.txt").read_text() == "x\n"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: (d / "instruction.md").unlink(), "missing instruction.md"),
        (lambda d: (d / "tests" / "test.sh").unlink(), "missing tests/test.sh"),
        (lambda d: (d / "solution" / "solve.sh").unlink(), "missing solution/solve.sh"),
        (lambda d: (d / "task.toml").write_text("[metadata\nid="), "not valid TOML"),
        (lambda d: _edit(d, 'id = "bad"\n', ""), r"\[metadata\] is missing 'id'"),
        (
            lambda d: _edit(d, "max_turns = 10", 'max_turns = "ten"'),
            r"\[limits\] max_turns has the wrong type",
        ),
        (lambda d: _edit(d, "max_turns = 10", "max_turns = 0"), "max_turns must be a positive"),
        (lambda d: _edit(d, "timeout = 10", "timeout = -1"), r"\[verifier\] timeout must be > 0"),
        (lambda d: _edit(d, "[verifier]\ntimeout = 10\n", ""), r"\[verifier\] is missing 'timeout'"),
        (lambda d: _edit(d, '"easy"', '"trivial"'), "difficulty must be one of"),
        (lambda d: _edit(d, "max_tokens = 4096", "max_tokens = 4096\nmax_tokenz = 1"), "unknown keys"),
        (lambda d: _edit(d, 'id = "bad"', 'id = "Bad Id!"'), "id must match"),
        (lambda d: (d / "instruction.md").write_text("  \n"), "instruction.md is empty"),
    ],
)
def test_loader_errors_name_the_dir_and_the_field(tmp_path, mutate, message):
    d = make_task(tmp_path, "bad", **GOOD)
    mutate(d)
    with pytest.raises(TaskError, match=message) as e:
        load_task(d)
    assert str(d) in str(e.value)


def _edit(d: Path, old: str, new: str) -> None:
    p = d / "task.toml"
    assert old in p.read_text()
    p.write_text(p.read_text().replace(old, new))


def test_duplicate_ids_and_empty_dirs(tmp_path):
    make_task(tmp_path, "one", **GOOD)
    make_task(tmp_path, "two", toml=TOML.format(id="one"), **GOOD)
    with pytest.raises(TaskError, match="also used by"):
        load_tasks(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="no task directories"):
        audit_tasks(tmp_path / "empty")


@needs_bwrap
def test_audit_reports_broken_tasks_with_reasons(tmp_path):
    make_task(tmp_path, "sound", **GOOD)
    make_task(tmp_path, "oracle-fails", solve="echo 41 > answer.txt\n", test=GOOD["test"])
    make_task(tmp_path, "oracle-crashes", solve="exit 3\n", test=GOOD["test"])
    make_task(tmp_path, "empty-passes", solve="true\n", test="exit 0\n")
    # The verifier passes whatever was given in environment/: doing nothing would be rewarded.
    make_task(tmp_path, "env-passes", env={"answer.txt": "42\n"}, **GOOD)
    make_task(
        tmp_path,
        "verifier-hangs",
        solve="true\n",
        test="sleep 100\n",
        toml=TOML.format(id="verifier-hangs").replace("timeout = 10", "timeout = 1"),
    )
    make_task(tmp_path, "no-toml", **GOOD)
    (tmp_path / "no-toml" / "task.toml").write_text("[metadata]\n")  # loads as broken, not a crash
    report = audit_tasks(tmp_path, jobs=2)
    by = {Path(a.path).name: a for a in report.audits}
    assert set(by) == {
        "sound",
        "oracle-fails",
        "oracle-crashes",
        "empty-passes",
        "env-passes",
        "verifier-hangs",
        "no-toml",
    }
    assert by["sound"].ok and by["sound"].oracle_passed and by["sound"].empty_failed
    assert not report.ok
    a = by["oracle-fails"]
    assert a.verdict == "broken" and not a.oracle_passed and a.empty_failed
    assert a.reasons == ("verifier after the oracle exited 1",)
    a = by["oracle-crashes"]
    assert not a.oracle_passed and "oracle solution/solve.sh exited 3" in a.reasons[0]
    for name in ("empty-passes", "env-passes"):
        a = by[name]
        assert a.oracle_passed and not a.empty_failed, name
        assert a.reasons == ("verifier passes the untouched workspace",)
    a = by["verifier-hangs"]
    assert not a.ok and any("stopped by the wall limit" in r for r in a.reasons)
    assert "does not load" in by["no-toml"].reasons[0] and "missing 'id'" in by["no-toml"].reasons[0]
    table = report.table()
    assert "sound" in table and "broken" in table and "1/7 tasks pass the audit" in table


@needs_bwrap
def test_cli_audit_exit_status_and_json(tmp_path, capsys):
    make_task(tmp_path / "good", "sound", **GOOD)
    make_task(tmp_path / "bad", "empty-passes", solve="true\n", test="exit 0\n")
    assert main(["tasks", "audit", str(tmp_path / "good")]) == 0
    assert "1/1 tasks pass the audit" in capsys.readouterr().out
    assert main(["tasks", "audit", str(tmp_path / "bad"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["broken"] == 1 and out["audits"][0]["verdict"] == "broken"
    assert main(["tasks", "list", str(tmp_path), "--json"]) == 0
    assert sorted(t["id"] for t in json.loads(capsys.readouterr().out)) == ["empty-passes", "sound"]
    (tmp_path / "good" / "sound" / "instruction.md").unlink()
    assert main(["tasks", "list", str(tmp_path)]) == 2
    assert "missing instruction.md" in capsys.readouterr().err


@needs_bwrap
def test_verifier_sees_tests_read_only_and_not_the_solution(tmp_path):
    probe = "test -f /tests/test.sh && ! test -e /solution && ! touch /tests/x 2>/dev/null && test -w .\n"
    t = load_task(make_task(tmp_path, "probe", solve="true\n", test=probe))
    with workspace_root() as root:
        r = run_verifier(t, new_workspace(t, root))
    assert r.ok, r


def test_shipped_tasks_load_and_are_varied():
    tasks = load_tasks(SHIPPED)
    assert len(tasks) >= 20
    assert len({t.category for t in tasks}) >= 4
    for t in tasks:
        assert t.verifier_timeout <= 60 and t.instruction.strip()


@needs_bwrap
def test_shipped_tasks_pass_the_audit():
    report = audit_tasks(SHIPPED, jobs=2)
    assert len(report.audits) >= 20
    broken = {a.task: a.reasons for a in report.audits if not a.ok}
    assert not broken, broken
    assert all(a.seconds < 15 for a in report.audits), [(a.task, a.seconds) for a in report.audits]


@needs_bwrap
def test_hidden_checks_reject_a_hardcoded_answer(tmp_path):
    """The hidden checks are real: hard-coding the example from the instruction does not pass."""
    shutil.copytree(SHIPPED / "basic" / "fix-off-by-one", tmp_path / "t")
    d = tmp_path / "t"
    # An "oracle" that only hard-codes the visible example still fails the hidden cases.
    (d / "solution" / "solve.sh").write_text(
        "cat > window.py <<'EOF'\ndef moving_sums(xs, k):\n    return [3, 5, 7]\nEOF\n"
    )
    report = audit_tasks(d)
    assert not report.ok and "verifier after the oracle exited 1" in report.audits[0].reasons[0]
