"""The sandbox against adversarial commands: each is contained, reported, and the host unaffected.

Every case runs for real under bubblewrap. Limit cases run twice where this host allows cgroups
(memory + pids cgroups, and the rlimit-only path used where cgroups cannot be made).
"""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from jaxpi.sandbox import SandboxConfig, bwrap_path, run_sandboxed
from jaxpi.sandbox.limits import Cgroups

pytestmark = pytest.mark.skipif(
    bwrap_path() is None, reason="bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
)

REPO = Path(__file__).resolve().parents[1]
CFG = SandboxConfig(cpu_seconds=5, memory_mb=256, max_procs=32, wall_seconds=10.0)


def _cgroups_available() -> bool:
    cg = Cgroups.create(CFG)
    if cg is None:
        return False
    cg.remove()
    return True


MODES = ["rlimit"] + (["cgroup"] if _cgroups_available() else [])


def _cfg(mode: str, **kw) -> SandboxConfig:
    return CFG.replace(use_cgroups=(mode == "cgroup"), **kw)


@pytest.fixture
def ws():
    """A workspace under a directory others may search (see test_unreachable_workspace_is_refused)."""
    base = Path(tempfile.mkdtemp(prefix="jaxpi-sandbox-test-"))
    base.chmod(0o711)
    (base / "ws").mkdir()
    yield base / "ws"
    shutil.rmtree(base)


def _sh(cmd: str, ws: Path, cfg: SandboxConfig = CFG, **kw):
    return run_sandboxed(["bash", "-c", cmd], ws, cfg, **kw)


def _procs_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    out.append(int(name))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("mode", MODES)
def test_workspace_is_writable_and_what_the_command_sees(ws, mode):
    (ws / "given.txt").write_text("from the host\n")
    r = _sh("cat given.txt && echo made > made.txt && pwd && ls / && echo $HOME", ws, _cfg(mode), stdin="")
    assert r.ok, r
    lines = r.stdout.splitlines()
    assert lines[0] == "from the host" and lines[1] == "/workspace"
    assert "root" not in lines and "home" not in lines and "work" not in lines  # nothing else of the host
    assert (ws / "made.txt").read_text() == "made\n"
    # The workspace is handed back to its owner after the run.
    assert (ws / "made.txt").stat().st_uid == ws.stat().st_uid == os.getuid()


@pytest.mark.parametrize("mode", MODES)
def test_writable_mount_beside_the_workspace(ws, mode):
    # An agent's config home: writable inside, kept on the host, handed back to its owner.
    home = ws.parent / "home"
    home.mkdir()
    (home / "models.json").write_text("{}")
    r = _sh(
        "cat /agent/models.json && echo s > /agent/session.jsonl", ws, _cfg(mode), rw_mounts={"/agent": home}
    )
    assert r.ok and r.stdout == "{}", r
    assert (home / "session.jsonl").read_text() == "s\n" and (
        home / "session.jsonl"
    ).stat().st_uid == os.getuid()
    with pytest.raises(ValueError, match="writable mount"):
        _sh("true", ws, rw_mounts={"/agent": home / "models.json"})


def test_stdin_env_and_exit_status(ws):
    r = run_sandboxed(
        ["bash", "-c", "read x; echo $x-$FOO; exit 7"], ws, CFG, env={"FOO": "bar"}, stdin="in\n"
    )
    assert r.returncode == 7 and r.stdout == "in-bar\n" and r.killed_reason is None and not r.ok


def test_system_is_read_only_and_host_files_unchanged(ws):
    before = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    r = _sh("echo x > /etc/passwd", ws)
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == before
    for cmd in ("touch /usr/bin/evil", "mkdir /evil", "echo x >> /bin/sh"):
        r = _sh(cmd, ws)
        assert r.returncode != 0, cmd
    assert not Path("/usr/bin/evil").exists() and not Path("/evil").exists()
    # Secrets in /etc are masked.
    r = _sh("cat /etc/shadow | head -c 10 | wc -c", ws)
    assert r.stdout.strip() == "0"


def test_checkout_is_not_writable(ws):
    target = REPO / "sandbox_escape_probe.txt"
    r = _sh(f"echo pwned > {target}; mkdir -p {REPO}/x && echo pwned > {REPO}/x/y; ls {REPO}", ws)
    # What matters: nothing reached the host's checkout.
    assert not target.exists() and not (REPO / "x").exists()
    if not REPO.is_relative_to("/tmp"):
        assert r.returncode != 0  # the path does not exist inside
    else:
        # A checkout under /tmp: the path lands in the sandbox's private tmpfs, gone with it.
        assert "sandbox_escape_probe.txt" not in r.stdout


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello from {self.server.server_address[1]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def two_servers():
    """Two HTTP servers on the host's loopback: the allowed endpoint and a forbidden one."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [s.server_address[1] for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


_FETCH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())
except Exception as e:
    print("FAILED", type(e).__name__, e); sys.exit(1)
"""


def test_network_only_the_endpoint(ws, two_servers):
    allowed, other = two_servers
    cfg = CFG.replace(endpoints=(("127.0.0.1", allowed),))
    (ws / "fetch.py").write_text(_FETCH)

    def fetch(url: str):
        return run_sandboxed(["python3", "fetch.py", url], ws, cfg)

    ok = fetch(f"http://127.0.0.1:{allowed}/")
    assert ok.returncode == 0 and ok.stdout.strip() == f"hello from {allowed}", ok
    # Twice in one sandbox: the relay serves more than one connection.
    r = run_sandboxed(
        [
            "bash",
            "-c",
            f"python3 fetch.py http://127.0.0.1:{allowed}/ && python3 fetch.py http://127.0.0.1:{allowed}/",
        ],
        ws,
        cfg,
    )
    assert r.stdout.count("hello from") == 2, r
    for url in (
        f"http://127.0.0.1:{other}/",
        "http://1.1.1.1/",
        "http://93.184.216.34/",
        "http://example.com/",
    ):
        r = fetch(url)
        assert r.returncode == 1 and r.stdout.startswith("FAILED"), (url, r)
    if Path("/usr/bin/curl").exists():
        r = _sh(f"curl -sS -m 3 http://127.0.0.1:{other}/ ; curl -sS -m 3 http://1.1.1.1/", ws, cfg)
        assert "hello" not in r.stdout and r.returncode != 0
    # Without endpoints even the allowed port is unreachable.
    r = run_sandboxed(["python3", "fetch.py", f"http://127.0.0.1:{allowed}/"], ws, CFG)
    assert r.returncode == 1


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_contained_and_reported(ws, mode):
    t0 = time.monotonic()
    r = _sh(":(){ :|:& };:; sleep 100", ws, _cfg(mode))
    assert r.killed_reason == "procs", r
    assert r.peak_procs <= CFG.max_procs + 2
    assert time.monotonic() - t0 < 8.0
    # The host can still make processes.
    for _ in range(5):
        assert subprocess.run(["true"]).returncode == 0


_PY_FORK_BOMB = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"


def test_python_fork_loop_is_contained(ws):
    (ws / "bomb.py").write_text(_PY_FORK_BOMB)
    r = run_sandboxed(["python3", "bomb.py"], ws, CFG)
    assert r.killed_reason == "procs", r
    assert not _procs_with("bomb.py")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "program",
    ["b = bytearray(4 << 30)", "a = []\nwhile True:\n    a.append(bytearray(64 << 20))"],
    ids=["one_4GB_block", "growing"],
)
def test_memory_hog_is_stopped_and_reported(ws, mode, program):
    (ws / "hog.py").write_text(program + "\nprint('survived')\n")
    r = run_sandboxed(["python3", "hog.py"], ws, _cfg(mode))
    assert r.killed_reason == "memory", r
    assert r.returncode != 0 and "survived" not in r.stdout
    assert r.cgroups == (mode == "cgroup")


@pytest.mark.parametrize("mode", MODES)
def test_memory_of_many_processes_counts_together(ws, mode):
    # 6 x 100 MB: each process is under 256 MB, the tree is not.
    cmd = "for i in 1 2 3 4 5 6; do python3 -c 'import time; b = bytearray(100 << 20); time.sleep(2)' & done; wait"
    r = _sh(cmd, ws, _cfg(mode))
    assert r.killed_reason == "memory", r


def test_sleep_forever_is_killed_at_the_wall_limit(ws):
    marker = "987654321"
    t0 = time.monotonic()
    r = _sh(f"sleep {marker}; echo never", ws, CFG.replace(wall_seconds=1.5))
    took = time.monotonic() - t0
    assert r.timed_out and r.killed_reason == "wall" and "never" not in r.stdout
    assert 1.5 <= took < 4.0
    assert not _procs_with(marker)


def test_background_process_does_not_outlive_the_sandbox(ws):
    marker = "987654322"
    r = _sh(f"nohup sleep {marker} >/dev/null 2>&1 & setsid sleep {marker}1 & disown; echo started", ws)
    assert r.ok and r.stdout == "started\n"
    time.sleep(0.2)
    assert not _procs_with(marker)


def test_cpu_limit(ws):
    r = run_sandboxed(["python3", "-c", "while True: pass"], ws, CFG.replace(cpu_seconds=1))
    assert r.killed_reason == "cpu" and r.returncode != 0, r


def test_config_is_validated(ws):
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxConfig(memory_mb=0)
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxConfig(wall_seconds=-1)
    with pytest.raises(ValueError, match="endpoints"):
        SandboxConfig(endpoints=(("127.0.0.1", 70000),))
    with pytest.raises(ValueError, match="1024"):
        SandboxConfig(endpoints=(("127.0.0.1", 80),))
    with pytest.raises(ValueError, match="given twice"):
        SandboxConfig(endpoints=(("127.0.0.1", 8000), ("10.0.0.1", 8000)))
    with pytest.raises(ValueError, match="workspace_mount"):
        SandboxConfig(workspace_mount="/etc")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        run_sandboxed(["true"], ws / "missing", CFG)


def test_workspace_under_a_private_directory_is_staged(tmp_path):
    # pytest's tmp_path sits under a 0700 directory: the caller copies the workspace in and out,
    # so the sandbox's unprivileged uid need not reach it on the host.
    (tmp_path / "in.txt").write_text("x\n")
    r = run_sandboxed(["bash", "-c", "cat in.txt > out.txt"], tmp_path, CFG)
    assert r.ok, r
    assert (tmp_path / "out.txt").read_text() == "x\n"


def test_read_only_mount_under_a_private_directory(ws, tmp_path):
    # bwrap binds by path as the sandbox's uid; the helper binds the source where that uid can
    # reach it first, so the directories above the source need not be searchable by others.
    tool = tmp_path / "tool"
    tool.mkdir()
    (tool / "run").write_text("echo from the tool\n")
    (tmp_path / "one.txt").write_text("one file\n")
    r = _sh(
        "bash /opt/tool/run; cat /opt/one.txt",
        ws,
        CFG,
        mounts={"/opt/tool": tool, "/opt/one.txt": tmp_path / "one.txt"},
    )
    assert r.ok and r.stdout == "from the tool\none file\n", r
    assert not (tool / "x").exists()
    r = _sh("touch /opt/tool/x", ws, CFG, mounts={"/opt/tool": tool})
    assert r.returncode != 0 and not (tool / "x").exists()


@pytest.mark.parametrize("mode", MODES)
def test_workspace_round_trip(ws, mode):
    """What the command leaves is what the host finds: contents, modes, times, symlinks as links,
    removals; set-id bits and special files do not come out (the latter noted)."""
    (ws / "keep.txt").write_text("kept\n")
    (ws / "gone.txt").write_text("removed inside\n")
    (ws / "sub" / "deep").mkdir(parents=True)
    (ws / "sub" / "deep" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (ws / "sub" / "deep" / "run.sh").chmod(0o755)
    os.utime(ws / "keep.txt", (1_000_000_000, 1_000_000_000))
    cmd = (
        "test -x sub/deep/run.sh && sub/deep/run.sh > ran.txt; rm gone.txt; mkdir empty; "
        "ln -s /etc/passwd link; ln keep.txt hard; mkfifo pipe; cp /bin/true suid; chmod 4755 suid; "
        "stat -c %Y keep.txt"
    )
    r = _sh(cmd, ws, _cfg(mode))
    assert r.ok, r
    assert r.stdout.strip() == "1000000000"  # times are copied in
    names = sorted(p.name for p in ws.iterdir())
    assert names == ["empty", "hard", "keep.txt", "link", "ran.txt", "sub", "suid"], names
    assert (ws / "ran.txt").read_text() == "ran\n" and (ws / "hard").read_text() == "kept\n"
    assert (ws / "link").is_symlink() and os.readlink(ws / "link") == "/etc/passwd"
    assert (ws / "keep.txt").stat().st_mtime == 1_000_000_000  # and back out
    assert (ws / "sub" / "deep" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (ws / "suid").stat().st_mode & 0o7777 == 0o755
    assert any("pipe" in n and "not a regular file" in n for n in r.notes), r.notes
    for p in ws.rglob("*"):
        assert p.lstat().st_uid == os.getuid(), p


@pytest.mark.parametrize("mode", MODES)
def test_workspace_larger_than_the_quota_is_refused(ws, mode):
    (ws / "big").write_bytes(b"x" * (3 << 20))
    with pytest.raises(ValueError, match="disk quota"):
        _sh("true", ws, _cfg(mode, disk_mb=2))
    assert (ws / "big").stat().st_size == 3 << 20  # untouched


@pytest.mark.parametrize("mode", MODES)
def test_a_full_disk_quota_is_reported(ws, mode):
    r = _sh("head -c 8M /dev/zero > f", ws, _cfg(mode, disk_mb=4))
    assert r.returncode != 0 and r.killed_reason == "disk", r


def test_only_stdio_reaches_the_command(ws):
    # bwrap passes on every descriptor it does not consume: the host's must not be among them.
    r = _sh("ls /proc/self/fd", ws, CFG.replace(endpoints=(("127.0.0.1", 9999),)))
    assert r.ok and r.stdout.split() == ["0", "1", "2", "3"], r  # 3: ls's own listing


def test_concurrent_sandboxes_from_threads(ws):
    """The rollout runner calls from many threads at once: each run keeps its own workspace/output."""
    from concurrent.futures import ThreadPoolExecutor

    dirs = []
    for i in range(6):
        (ws / f"w{i}").mkdir()
        dirs.append(ws / f"w{i}")

    def one(i: int):
        return run_sandboxed(["bash", "-c", f"echo {i} > mine.txt; ls; echo run-{i}"], dirs[i], CFG)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for i, r in enumerate(results):
        assert r.ok and r.stdout == f"mine.txt\nrun-{i}\n", r
        assert (dirs[i] / "mine.txt").read_text() == f"{i}\n"
