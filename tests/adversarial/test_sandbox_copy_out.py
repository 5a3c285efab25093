"""What the host copies out of a sandbox's tree must be what the sandbox wrote, and nothing else.

The Pi runner copies Pi's session file out of the config home the sandbox had writable. A command
in the sandbox can plant anything there: a symlink to a root-only host file, a hard link, a FIFO
(which would block a reader for ever), a symlinked directory, a file of any size.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from jaxpi.runner import attempt
from jaxpi.sandbox import SandboxConfig, bwrap_path, run_sandboxed

needs_bwrap = pytest.mark.skipif(
    bwrap_path() is None, reason="bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
)
CFG = SandboxConfig(cpu_seconds=5, memory_mb=256, max_procs=32, wall_seconds=10.0)


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="jaxpi-adv-copy-"))
    d.chmod(0o711)
    for sub in ("ws", "home", "out"):
        (d / sub).mkdir()
    yield d
    shutil.rmtree(d)


@pytest.fixture
def host_secret(base):
    """A 0600 file of the caller's, outside anything the sandbox is given."""
    secret = "jaxpi-secret-" + secrets.token_hex(8)
    d = base / "private"
    d.mkdir(mode=0o700)
    path = d / "credentials"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path, secret


def _no_secret_in(out: Path, secret: str) -> None:
    for p in out.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert secret not in p.read_text(errors="replace"), p


@needs_bwrap
def test_a_planted_session_symlink_is_not_followed(base, host_secret):
    path, secret = host_secret
    plant = f"mkdir -p /pi/sessions/--workspace-- && ln -s {path} /pi/sessions/--workspace--/9999_x.jsonl"
    r = run_sandboxed(["bash", "-c", plant], base / "ws", CFG, rw_mounts={"/pi": base / "home"})
    assert r.ok, r
    with pytest.raises(ValueError, match="symlink"):
        attempt._copy_session(base / "home", base / "out")
    assert not (base / "out" / "session.jsonl").exists()
    _no_secret_in(base / "out", secret)


def test_a_symlinked_sessions_directory_is_not_followed(base, host_secret):
    path, secret = host_secret
    (base / "home" / "sessions").symlink_to(path.parent)
    (path.parent / "a.jsonl").write_text(secret + "\n")
    with pytest.raises(ValueError, match="symlink"):
        attempt._copy_session(base / "home", base / "out")
    _no_secret_in(base / "out", secret)


def test_a_hard_link_to_a_host_file_is_refused(base, host_secret):
    path, secret = host_secret
    (base / "home" / "sessions").mkdir()
    os.link(path, base / "home" / "sessions" / "a.jsonl")
    with pytest.raises(ValueError, match="hard link"):
        attempt._copy_session(base / "home", base / "out")
    _no_secret_in(base / "out", secret)


def test_a_fifo_is_refused_without_blocking(base):
    (base / "home" / "sessions").mkdir()
    os.mkfifo(base / "home" / "sessions" / "a.jsonl")
    with pytest.raises(ValueError, match="not a regular file"):
        attempt._copy_session(base / "home", base / "out")


def test_an_oversized_session_is_refused(base, monkeypatch):
    monkeypatch.setattr(attempt, "MAX_SESSION_BYTES", 4096)
    (base / "home" / "sessions").mkdir()
    (base / "home" / "sessions" / "a.jsonl").write_bytes(b"{}\n" * 2000)
    with pytest.raises(ValueError, match="larger than"):
        attempt._copy_session(base / "home", base / "out")
    assert not list((base / "out").iterdir())


def test_a_regular_session_is_copied(base):
    d = base / "home" / "sessions" / "--workspace--"
    d.mkdir(parents=True)
    (d / "0001_a.jsonl").write_text('{"old": 1}\n')
    (d / "0002_b.jsonl").write_text('{"type": "session"}\n')
    dst = attempt._copy_session(base / "home", base / "out")
    assert dst == base / "out" / "session.jsonl" and dst.read_text() == '{"type": "session"}\n'
    assert attempt._copy_session(base / "ws", base / "out") is None  # no sessions at all
