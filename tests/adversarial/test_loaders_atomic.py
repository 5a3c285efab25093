"""Interrupted and permission-bound writes: `save_hf` (convert), `save_peft` (export), report files.

A save killed with SIGKILL half way leaves its hidden `.NAME.partial-*` directory; the next save
of the same output must remove it (and only leftovers whose writer is gone), and nothing that
looks complete may appear at the output. Outputs get the permissions a plain `mkdir` / `open`
would give under the caller's umask, not `mkdtemp`'s 0700 or `mkstemp`'s 0600 (a vLLM container
running as another user must be able to read an export).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxpi.config import TINY

CFG = TINY.replace(num_hidden_layers=4)


@pytest.fixture(scope="module")
def model():
    from jaxpi.hf_fixtures import random_jax_model

    return random_jax_model(CFG, seed=1)


@pytest.fixture
def umask():
    """Set the process umask for one test; restored after."""
    saved = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(saved)


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(
        p.name for p in parent.iterdir() if p.name.startswith((f".{name}.partial-", f".{name}.old-"))
    )


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import jaxpi.convert.hf as hf
    from jaxpi.config import TINY
    from jaxpi.hf_fixtures import random_jax_model

    real, shards = hf.write_file, []

    def write_then_die(path, planned, *args, **kwargs):
        shards.append(path)
        if len(shards) == 3:  # two shards are on disk: kill -9, no cleanup handler runs
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, planned, *args, **kwargs)

    hf.write_file = write_then_die
    model = random_jax_model(TINY.replace(num_hidden_layers=4), seed=1)
    hf.save_hf(model, sys.argv[1], max_shard_bytes=200_000)
    """
)


def test_a_killed_save_leaves_a_partial_that_the_next_save_removes(model, tmp_path):
    from jaxpi.convert.hf import save_hf

    out = tmp_path / "export"
    r = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, str(out)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = _leftovers(tmp_path, "export")
    assert len(left) == 1 and left[0].startswith(".export.partial-"), left
    assert len(list((tmp_path / left[0]).glob("model-*.safetensors"))) == 2  # it really was half written
    assert not out.exists()  # nothing that looks complete

    save_hf(model, out, max_shard_bytes=200_000)
    assert _leftovers(tmp_path, "export") == []
    assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()


def test_leftovers_of_live_writers_are_kept_and_dead_ones_removed(model, tmp_path):
    from jaxpi import atomic
    from jaxpi.convert.hf import save_hf

    out = tmp_path / "export"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host, start = atomic._host(), atomic._start_time(sleeper.pid)
        live = tmp_path / f".export.partial-{host}-{sleeper.pid}-{start}-abcd1234"
        reused = (
            tmp_path / f".export.partial-{host}-{sleeper.pid}-{start + 1}-abcd1234"
        )  # same pid, other process
        other_host = tmp_path / f".export.partial-00000000-{os.getpid()}-1-abcd1234"
        unrelated = tmp_path / ".export.partial-by-someone-else"
        for d in (live, reused, other_host, unrelated):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"half")
        save_hf(model, out)
        assert live.exists() and other_host.exists() and unrelated.exists()  # in use, or not ours to judge
        assert not reused.exists()  # its writer is gone: the pid now names a younger process
    finally:
        sleeper.kill()
        sleeper.wait()
    save_hf(model, out, overwrite=True)
    assert not live.exists()  # the sleeper is dead now


def test_leftovers_from_before_owners_were_recorded_are_removed_once_quiet(model, tmp_path):
    from jaxpi.convert.hf import save_hf

    quiet, busy = tmp_path / ".export.partial-abcd1234", tmp_path / ".export.partial-efgh5678"
    for d in (quiet, busy):
        d.mkdir()
        (d / "model-00001-of-00002.safetensors").write_bytes(b"half")
    hours_ago = os.path.getmtime(quiet) - 2 * 3600
    for p in (quiet / "model-00001-of-00002.safetensors", quiet):
        os.utime(p, (hours_ago, hours_ago))
    save_hf(model, tmp_path / "export")
    assert not quiet.exists() and busy.exists()  # busy: written to a moment ago, maybe still


def test_an_overwrite_killed_between_its_renames_is_rolled_back(model, tmp_path):
    from jaxpi import atomic
    from jaxpi.convert.hf import save_hf

    out = tmp_path / "export"
    save_hf(model, out)
    before = (out / "model.safetensors").read_bytes()
    # what a kill between `out -> .old-*/export` and `.partial-* -> out` leaves: no `out`, the old
    # export aside, a finished new one still hidden (pid 2**22 + 7 names no process)
    dead = f"{atomic._host()}-{2**22 + 7}-5"
    aside = tmp_path / f".export.old-{dead}-abcd1234"
    aside.mkdir()
    out.rename(aside / "export")
    (tmp_path / f".export.partial-{dead}-efgh5678").mkdir()
    assert not out.exists()

    save_hf(model, tmp_path / "export", overwrite=True)
    assert _leftovers(tmp_path, "export") == []
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_convert_output_has_the_umask_permissions(model, tmp_path, umask, mask):
    from jaxpi.convert.hf import save_hf

    umask(mask)
    src = tmp_path / "src"
    save_hf(model, src)
    (src / "tokenizer_config.json").write_text("{}")
    (src / "tokenizer_config.json").chmod(0o600)  # the source's own mode is not what an export gets
    out = save_hf(model, tmp_path / "out", source=src)
    assert _mode(out) == 0o777 & ~mask
    for f in out.iterdir():
        assert _mode(f) == 0o666 & ~mask, f.name


def test_export_output_has_the_umask_permissions_and_cleans_leftovers(model, tmp_path, umask):
    import jax

    from jaxpi import atomic
    from jaxpi.convert.hf import save_hf
    from jaxpi.lora import LoraConfig, add_lora
    from jaxpi.lora.peft import save_peft

    umask(0o022)
    base = save_hf(model, tmp_path / "base")
    lcfg = LoraConfig(rank=2, targets=("q_proj", "down_proj"))
    add_lora(model, lcfg, key=jax.random.key(0))
    dead = tmp_path / f".adapter.partial-{atomic._host()}-{2**22 + 7}-5-abcd1234"
    dead.mkdir()
    out = save_peft(model, lcfg, tmp_path / "adapter", base_dir=base)
    assert _mode(out) == 0o755 and all(_mode(f) == 0o644 for f in out.iterdir())
    assert not dead.exists()


def test_report_files_have_the_umask_permissions(tmp_path, umask):
    from jaxpi.atomic import write_text  # what jaxpi report writes report.json with
    from jaxpi.eval.run import write_atomic

    umask(0o022)
    for f in (
        write_atomic(tmp_path / "results.json", "{}"),
        write_text(tmp_path / "report.json", "{}"),
    ):
        assert _mode(f) == 0o644 and f.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "results.json"]
