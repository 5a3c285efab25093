"""A run that fails before its first step leaves output.dir as it found it (jaxpi.train.rundir),
and says why in one line: `jaxpi sft` and `jaxpi grpo` with a base that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi.cli import main
from jaxpi.train.rundir import new_paths

ROOT = Path(__file__).resolve().parents[1]
NAMES = st.sampled_from(["config.json", "checkpoints", "base", "run.json", "keep", "notes"])


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@fixed_seed(11)
@settings(max_examples=30, deadline=None)
@given(
    existed=st.one_of(st.none(), st.sets(NAMES, max_size=4)),
    added=st.sets(NAMES, min_size=1, max_size=5),
    depth=st.integers(0, 2),
    kept=st.booleans(),
)
def test_a_failed_start_removes_only_what_it_added(tmp_path_factory, existed, added, depth, kept):
    """`existed` None: the run dir (and `depth` parents) did not exist; else the names in it."""
    root = tmp_path_factory.mktemp("runs")
    run_dir = root.joinpath(*[f"p{i}" for i in range(depth)], "run")
    if existed is not None:
        run_dir.mkdir(parents=True)
        for name in existed:
            (run_dir / name).write_text("before")
    before = tree(root)
    with pytest.raises(RuntimeError), new_paths(run_dir) as made:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in added:
            path = run_dir / name
            if name in (existed or ()):
                path.write_text("rewritten")  # what was there stays (a resume rewrites config.json)
            else:
                (path / "inner").mkdir(parents=True) if name in ("checkpoints", "base") else path.write_text(
                    "new"
                )
        if kept:
            made.keep()
        raise RuntimeError("the base does not load")
    if kept:
        assert tree(root) >= before and {n for n in added} <= set(os.listdir(run_dir))
    else:
        assert tree(root) == before


def run_cli(tmp_path: Path, *argv: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return proc.returncode, proc.stderr


def test_sft_with_a_missing_base_says_so_in_one_line_and_leaves_nothing(tmp_path):
    code, err = run_cli(tmp_path, "sft", "--config", "tiny", "model.base=/nonexistent", "output.dir=runs/a")
    assert code == 2
    assert (
        err.startswith("jaxpi sft: error: model.base /nonexistent has no config.json")
        and err.count("\n") == 1
    )
    assert list(tmp_path.iterdir()) == []  # not runs/a, nor runs/


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_a_failed_start_keeps_a_directory_that_was_there(command, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main([command, "--config", "tiny", "model.base=/nonexistent", f"output.dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxpi {command}: error: model.base") and err.count("\n") == 1
    assert tree(tmp_path) == {"mine", "mine/notes.txt"}
    assert (
        main([command, "--config", "tiny", "model.base=/nonexistent", f"output.dir={tmp_path}/new/run"]) == 2
    )
    assert tree(tmp_path) == {"mine", "mine/notes.txt"}


def test_sft_failing_after_building_its_base_removes_the_base(tmp_path, capsys):
    """The tiny base is written into the run dir; a tokenizer without a chat template then stops
    the run before step 1, and the base goes with the rest."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "run"
    assert main(["sft", "--config", "tiny", f"data.tokenizer={tmp_path / 'tok'}", f"output.dir={out}"]) == 2
    assert not out.exists()
