"""Probes of the sandbox's limits that per-process rlimits do not cover: disk, CPU over a whole
tree, relay connections, and what of the task the verifier and oracle are given.

With cgroups and without (`use_cgroups=False`) where this host can make them.
"""

from __future__ import annotations

import selectors
import shutil
import socket
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

CFG = SandboxConfig(cpu_seconds=5, memory_mb=256, max_procs=32, wall_seconds=10.0)


def _cgroups(cfg: SandboxConfig = CFG) -> Cgroups | None:
    cg = Cgroups.create(cfg)
    if cg is not None:
        cg.remove()
    return cg


MODES = ["rlimit"] + (["cgroup"] if _cgroups() is not None else [])


def _cfg(mode: str, **kw) -> SandboxConfig:
    return CFG.replace(use_cgroups=(mode == "cgroup"), **kw)


@pytest.fixture
def ws():
    base = Path(tempfile.mkdtemp(prefix="jaxpi-adv-"))
    base.chmod(0o711)
    (base / "ws").mkdir()
    yield base / "ws"
    shutil.rmtree(base)


def _mounts() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


@pytest.mark.parametrize("mode", MODES)
def test_disk_quota_refuses_a_big_fallocate(ws, mode):
    home = ws.parent / "home"
    home.mkdir()
    cmd = (
        "fallocate -l 512M big && echo MADE big; "
        "fallocate -l 512M /agent/big && echo MADE agent; "
        "head -c 1000000 /dev/zero > small && echo small ok"
    )
    r = run_sandboxed(["bash", "-c", cmd], ws, _cfg(mode, disk_mb=64), rw_mounts={"/agent": home})
    assert "MADE" not in r.stdout and "small ok" in r.stdout, r
    assert (ws / "small").stat().st_size == 1000000
    for d in (ws, home):
        assert sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) < 64 << 20


@pytest.mark.parametrize("mode", MODES)
def test_a_wall_clock_kill_leaves_nothing_big_behind(ws, mode):
    mounts = _mounts()
    cmd = "dd if=/dev/zero of=big bs=1M count=100000 2>/dev/null; sleep 100"
    r = run_sandboxed(["bash", "-c", cmd], ws, _cfg(mode, disk_mb=64, wall_seconds=1.5))
    assert r.killed_reason == "wall", r
    # What the run left is its workspace, copied back out: at most the quota.
    assert sum(p.stat().st_size for p in ws.rglob("*") if p.is_file()) <= 64 << 20
    assert _mounts() == mounts  # no staging mount left behind on the host


_SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.45:\n    pass\n"


@pytest.mark.parametrize("mode", MODES)
def test_cpu_seconds_bound_a_chain_of_short_spinners(ws, mode):
    # Each process stays under the limit; together they are far over it.
    (ws / "spin.py").write_text(_SPIN)
    r = run_sandboxed(
        ["bash", "-c", "for i in 1 2 3 4 5 6 7 8; do python3 spin.py; done; echo DONE"],
        ws,
        _cfg(mode, cpu_seconds=1),
    )
    assert r.killed_reason == "cpu" and "DONE" not in r.stdout, r
    assert r.cpu_seconds < 1.6, r


@pytest.mark.skipif(
    getattr(_cgroups(), "cpu_dir", None) is None, reason="no cpu cgroup controller on this host"
)
def test_cpu_bandwidth_is_cgroup_wide(ws):
    spin = "timeout 1.5 sh -c 'while :; do :; done'"
    r = run_sandboxed(["bash", "-c", f"{spin} & {spin} & wait"], ws, CFG.replace(use_cgroups=True, cpus=0.5))
    assert r.ok, r
    # Two busy shells for 1.5 s hold at most half a CPU between them.
    assert r.cpu_seconds < 1.0, r


class _EchoServer:
    """A one-thread TCP echo server that keeps every connection open (and counts them)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.open = self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.05):
                if key.fileobj is self.sock:
                    conn, _ = self.sock.accept()
                    conn.setblocking(False)
                    self.sel.register(conn, selectors.EVENT_READ)
                    self.open += 1
                    self.peak = max(self.peak, self.open)
                    continue
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if data:
                    key.fileobj.send(data)
                else:
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.open -= 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()


_CLIENT = r"""
import socket, sys, time
port, n, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + 6
held, echoed = [], 0
for i in range(n):
    if time.monotonic() > deadline:
        break
    try:
        if how == "tcp":  # through the relay inside, as a client would
            s = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        else:  # straight to the host's unix socket, around the relay inside
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(0.5)
            s.connect(f"/run/jaxpi/ep-{port}.sock")
        s.settimeout(0.5)
        s.sendall(b"ping")
        if s.recv(4) == b"ping":
            echoed += 1
        held.append(s)
    except OSError:
        pass
print(echoed, len(held))
"""


@pytest.mark.parametrize("how", ["tcp", "unix"])
def test_relay_connections_are_capped_and_its_threads_end_with_the_run(ws, how):
    server = _EchoServer()
    try:
        cfg = CFG.replace(max_procs=16, endpoints=(("127.0.0.1", server.port),), max_connections=8)
        (ws / "client.py").write_text(_CLIENT)
        before, peak = threading.active_count(), [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], threading.active_count())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            r = run_sandboxed(["python3", "client.py", str(server.port), "600", how], ws, cfg)
        finally:
            stop.set()
            sampler.join()
        assert r.ok, r
        echoed = int(r.stdout.split()[0])
        # Exactly the cap got through; the rest were refused, not queued.
        assert echoed == 8 and server.peak <= 8, (r.stdout, server.peak)
        # The sampler is one of the threads seen; the host half adds a bounded few, not one per connection.
        assert peak[0] - before <= 8, peak[0] - before
        deadline = time.monotonic() + 2.0
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threading.active_count() == before, threading.enumerate()
        deadline = time.monotonic() + 2.0
        while server.open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.open == 0  # every upstream connection was closed with the run
    finally:
        server.close()


def _task(root: Path) -> Path:
    """A task whose tests/ and solution/ only their owner may read (root, when the caller is)."""
    d = root / "task"
    for sub in ("tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "instruction.md").write_text("Write 42 to answer.txt.\n")
    (d / "task.toml").write_text(
        '[metadata]\nid = "staged"\ncategory = "shell"\ndifficulty = "easy"\n'
        "[limits]\nwall_seconds = 20\nmax_turns = 5\nmax_tokens = 1000\n[verifier]\ntimeout = 10\n"
    )
    (d / "tests" / "expected.txt").write_text("42\n")
    (d / "tests" / "test.sh").write_text("diff answer.txt /tests/expected.txt\n")
    (d / "solution" / "solve.sh").write_text("cat /solution/answer > answer.txt\n")
    (d / "solution" / "answer").write_text("42\n")
    for p in d.rglob("*"):
        p.chmod(0o700 if p.is_dir() else 0o600)
    d.chmod(0o700)
    return d


@pytest.mark.parametrize("mode", MODES)
def test_verifier_and_oracle_get_staged_copies_of_tests_and_solution(mode, monkeypatch):
    from jaxpi.tasks import load_task, new_workspace, run_oracle, run_verifier, workspace_root
    from jaxpi.tasks import run as task_run

    mounted = []

    def spy(argv, workspace, cfg, **kw):
        hosts = [Path(h) for h in (kw.get("mounts") or {}).values()]
        mounted.extend(hosts)
        # What the sandbox is given is a copy, whatever its path: never the task's own directory.
        assert not any(h.resolve().is_relative_to(task.path) for h in hosts), hosts
        return run_sandboxed(argv, workspace, cfg, **kw)

    monkeypatch.setattr(task_run, "run_sandboxed", spy)
    with workspace_root() as root:
        task = load_task(_task(root))
        ws = new_workspace(task, root)
        cfg = task_run.sandbox_config(task, 10.0).replace(use_cgroups=(mode == "cgroup"))
        oracle = run_oracle(task, ws, cfg)
        assert oracle.ok, oracle
        ver = run_verifier(task, ws, cfg)
        assert ver.ok, ver
    assert len(mounted) == 2 and not any(h.exists() for h in mounted)  # the copies are removed


def test_a_full_workspace_does_not_fail_the_verifier_for_want_of_room(tmp_path):
    from jaxpi.tasks import load_task, new_workspace, run_verifier, workspace_root

    d = tmp_path / "task"
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "instruction.md").write_text("Fill the disk.\n")
    (d / "task.toml").write_text(
        '[metadata]\nid = "full"\ncategory = "shell"\ndifficulty = "easy"\n'
        "[limits]\nwall_seconds = 20\nmax_turns = 5\nmax_tokens = 1000\ndisk_mb = 8\n[verifier]\ntimeout = 10\n"
    )
    # The verifier needs scratch space in the workspace, then fails the attempt on its merits.
    (d / "tests" / "test.sh").write_text("head -c 2M /dev/zero > scratch && test -f answer.txt\n")
    (d / "solution" / "solve.sh").write_text("echo 42 > answer.txt\n")
    task = load_task(d)
    with workspace_root() as root:
        ws = new_workspace(task, root)
        # The attempt fills its quota to the last block.
        r = run_sandboxed(
            ["bash", "-c", "cat /dev/zero > fill"], ws, CFG.replace(disk_mb=task.limits.disk_mb)
        )
        assert r.killed_reason == "disk", r
        ver = run_verifier(task, ws)
        # A failure of the attempt, scored as one: not a verifier that hit a limit.
        assert ver.returncode == 1 and ver.killed_reason is None, ver
