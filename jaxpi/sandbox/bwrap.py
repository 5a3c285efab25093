"""Run one command under bubblewrap: read-only system, a quota'd copy of the workspace, no network.

    result = run_sandboxed(["bash", "-lc", "make test"], workspace, SandboxConfig(wall_seconds=30))

Inside, the command sees: /usr (and the /bin, /lib* links), /etc read-only (shadow files masked),
the workspace read-write at `cfg.workspace_mount` (its working directory), a private tmpfs /tmp,
its own /proc (with /proc/sys read-only) and a minimal /dev; the root itself is read-only and
nothing else of the host is mounted (so neither the checkout nor $HOME exists in there). Every
namespace is new: user (no capabilities, no nested user namespaces), pid, network (loopback
only), ipc, uts, cgroup. It runs as an unprivileged uid as the host sees it too (`cfg.host_uid`
for a root caller, the caller's own uid otherwise), with no_new_privs, under a seccomp filter
(`jaxpi.sandbox.seccomp`), in an empty environment but for `BASE_ENV` and the caller's `env`.

The workspace and writable mounts are copies on a tmpfs of `cfg.disk_mb` made by the staging
helper (`jaxpi.sandbox.stage`) in a mount namespace of its own, and copied back when the command
ends. The host watches the sandbox's pid namespace while it runs and kills its init, which ends
every process in it, at the wall limit, the CPU budget, or when the process limit is reached. See
`jaxpi.sandbox.config` for the limits and `jaxpi.sandbox.relay` for the one way out (the
allowed endpoints).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxpi.sandbox import procs, seccomp
from jaxpi.sandbox.config import SandboxConfig, SandboxResult
from jaxpi.sandbox.limits import Cgroups, nproc_argv, rlimits
from jaxpi.sandbox.relay import INNER_RELAY, HostRelay

_RELAY_DIR = "/run/jaxpi"  # inside: the endpoint sockets and the relay script
_SANDBOX_UID = 1000
_MASKED = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers")
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# The staging helper's own environment: nothing of the caller's (bwrap's init would keep it).
_HELPER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_STAGE_PY = Path(__file__).with_name("stage.py")
# Only consulted without a memory cgroup: with RLIMIT_AS an allocation fails rather than being
# killed, and this is how the usual runtimes say so.
_ALLOC_FAILED = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")
_POLL_S = 0.03
# After the sandbox is killed, how long the helper may take to copy the trees back out.
_COPY_OUT_GRACE_S = 30.0


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def system_binds() -> list[str]:
    """bwrap arguments for the read-only system: /usr, the merged-/usr links (or real dirs), /etc."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        p = Path(top)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), top]
        elif p.is_dir():
            args += ["--ro-bind", top, top]
    args += ["--ro-bind", "/etc", "/etc"]
    for secret in _MASKED:
        if Path(secret).exists():
            args += ["--ro-bind", "/dev/null", secret]
    return args


def bwrap_argv(
    argv: Sequence[str],
    cfg: SandboxConfig,
    env: Mapping[str, str],
    fds: Mapping[str, int],
    relay_args: Sequence[str] = (),
    ro: Mapping[str, str] | None = None,
    rw: Mapping[str, str] | None = None,
    relay_dir: str | None = None,
) -> list[str]:
    """The full bwrap command line (pure but for a look at the host's top-level directories).

    `fds`: open descriptors for "info" (bwrap's --info-fd) and "seccomp" (the compiled filter).
    `ro` maps paths inside to the paths bwrap binds read-only there (`cfg.ro_binds` and the
    caller's mounts, in that order), `rw` the workspace (at `cfg.workspace_mount`) and writable
    mounts to theirs; `relay_dir` holds the endpoint sockets and the relay script. bwrap finds
    these by path as the sandbox's uid: they are the staging helper's (`run_sandboxed`'s run
    directory, mode 0711, as the helper's mount namespace has it).
    """
    bw = bwrap_path() or "bwrap"
    args = [bw, "--unshare-all", "--unshare-user", "--disable-userns"]
    args += ["--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID), "--hostname", "sandbox"]
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    args += system_binds()
    # /proc/sys read-only on top of the sandbox's own /proc (bwrap covers it only when its setup
    # could write there). The private /tmp comes before the binds: a bound path under /tmp (a
    # checkout or a toolchain living there) is then mounted on top of the tmpfs, not hidden by it.
    args += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev"]
    args += ["--size", str(cfg.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]
    for inside, src in (ro or {}).items():
        args += ["--ro-bind", src, inside]
    rw = dict(rw or {})
    ws = rw.pop(cfg.workspace_mount, None)
    for inside, src in rw.items():
        args += ["--bind", src, inside]
    if ws is not None:
        args += ["--bind", ws, cfg.workspace_mount]
    args += ["--chdir", cfg.workspace_mount]
    inner = nproc_argv(cfg)
    if relay_args:
        args += ["--ro-bind", str(relay_dir), _RELAY_DIR]
        # The relay binds its ports, forks to the background, and only then does the command start.
        launch = f'python3 {_RELAY_DIR}/relay.py {cfg.max_connections} {" ".join(relay_args)} && exec "$@"'
        inner += ["/bin/sh", "-c", launch, "sandbox"]
    args += ["--remount-ro", "/", "--clearenv"]
    for k, v in {**BASE_ENV, **env}.items():
        args += ["--setenv", k, v]
    args += ["--seccomp", str(fds["seccomp"]), "--info-fd", str(fds["info"]), "--"]
    return args + inner + list(argv)


def helper_argv(uid: int | None) -> list[str]:
    """How the staging helper starts: in a private mount namespace (and, for a caller that is not
    root, a user namespace where it may mount)."""
    ns = (
        ["--mount", "--propagation", "private"]
        if uid is not None
        else ["--user", "--map-root-user", "--mount", "--propagation", "private"]
    )
    return ["unshare", *ns, "--", sys.executable or "python3", "-I", "-S", str(_STAGE_PY)]


class _Drain(threading.Thread):
    """Read a pipe to its end, keeping the first `cap` bytes (a flood must not block the sandbox)."""

    def __init__(self, stream, cap: int) -> None:
        super().__init__(daemon=True)
        self.stream, self.cap, self.buf = stream, cap, bytearray()

    def run(self) -> None:
        while chunk := self.stream.read1(65536):
            if len(self.buf) < self.cap:
                self.buf += chunk[: self.cap - len(self.buf)]

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


def _read_child_pid(fd: int, deadline: float) -> int | None:
    """bwrap's --info-fd JSON: the host pid of the sandbox's init (pid 1 of its namespace)."""
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError):
            continue
    return None


def run_sandboxed(
    argv: Sequence[str],
    workspace: str | Path,
    cfg: SandboxConfig | None = None,
    env: Mapping[str, str] | None = None,
    stdin: str | bytes | None = None,
    mounts: Mapping[str, str | Path] | None = None,
    rw_mounts: Mapping[str, str | Path] | None = None,
) -> SandboxResult:
    """Run `argv` in a fresh sandbox over `workspace` and wait for it (at most cfg.wall_seconds).

    `env` is added to `BASE_ENV` (nothing of the caller's environment gets in). `mounts` maps
    paths inside to host paths bound read-only there (an agent's extension, a toolchain); their
    own modes must let the sandbox's uid read them (the directories above them need not).
    `rw_mounts` maps paths inside to host directories that
    are writable inside (an agent's config home, kept apart from the workspace the verifier sees).
    The workspace and `rw_mounts` are copied into the sandbox's quota'd tmpfs (`cfg.disk_mb` for
    all of them) and their contents replaced by what the sandbox left when it ends, killed or
    not: regular files, directories and symlinks, never followed; what was left out is listed in
    `SandboxResult.notes`. Raises ValueError when they do not fit in `cfg.disk_mb` to begin with.
    """
    cfg = cfg or SandboxConfig()
    if not argv:
        raise ValueError("run_sandboxed: empty argv")
    if bwrap_path() is None:
        raise FileNotFoundError("bwrap not found: install bubblewrap (Debian: apt-get install -y bubblewrap)")
    ws = Path(workspace).resolve()
    if not ws.is_dir():
        raise FileNotFoundError(f"run_sandboxed: workspace {ws} is not a directory")
    ro_mounts = {inside: Path(host).resolve() for inside, host in (mounts or {}).items()}
    rw = {inside: Path(host).resolve() for inside, host in (rw_mounts or {}).items()}
    for inside, host in [*ro_mounts.items(), *rw.items()]:
        if not Path(inside).is_absolute() or inside in ("/", cfg.workspace_mount) or not host.exists():
            raise ValueError(
                f"run_sandboxed: bad mount {inside!r} -> {host} (absolute, not / or the workspace, host path must exist)"
            )
    for inside, host in rw.items():
        if not host.is_dir():
            raise ValueError(f"run_sandboxed: writable mount {inside!r} -> {host} must be a directory")
    cgroups = Cgroups.create(cfg) if cfg.use_cgroups is not False else None
    if cfg.use_cgroups and cgroups is None:
        raise ValueError("SandboxConfig.use_cgroups=True but no v1 memory/pids cgroup could be created here")
    # Host root is exempt from RLIMIT_NPROC and owns most of the host: never the sandbox's uid.
    uid = cfg.host_uid if os.geteuid() == 0 else None
    run_dir = Path(tempfile.mkdtemp(prefix="jaxpi-run-"))
    # bwrap, as the sandbox's uid, finds what it binds by path below here; nothing else can change it.
    run_dir.chmod(0o711)
    relay = None
    info_r, info_w = os.pipe()
    status_r, status_w = os.pipe()
    passed: list[int] = []  # every descriptor the helper gets, closed here once it has them
    try:
        seccomp_fd = seccomp.memfd()
        passed = [info_w, status_w, seccomp_fd]
        # Trees the helper copies in and out (the workspace first), by descriptor: pinned.
        trees = []
        for inside, host in [(cfg.workspace_mount, ws), *rw.items()]:
            trees.append([inside, os.open(host, os.O_RDONLY | os.O_DIRECTORY)])
            passed.append(trees[-1][1])
        # Read-only sources, bound by the helper (as the caller) onto ro/N in its namespace, so that
        # the sandbox's uid reaches them whatever the modes of the directories above them. By path:
        # a mount cannot take its source from a descriptor of another mount namespace.
        (run_dir / "ro").mkdir(mode=0o711)
        ro, ro_binds = {}, []
        sources = [*((p, Path(p).resolve()) for p in cfg.ro_binds), *ro_mounts.items()]
        for i, (inside, host) in enumerate(sources):
            target = run_dir / "ro" / str(i)
            target.mkdir() if host.is_dir() else target.touch()
            ro_binds.append([str(host), str(target)])
            ro[inside] = str(target)
        (run_dir / "stage").mkdir()
        staged = {inside: str(run_dir / "stage" / str(i)) for i, (inside, _) in enumerate(trees)}
        relay_args: list[str] = []
        relay_dir = run_dir / "relay"
        if cfg.endpoints:
            relay_dir.mkdir(mode=0o711)
            relay_dir.chmod(0o711)  # the sandbox uid must reach the sockets inside (umask aside)
            relay = HostRelay(cfg.endpoints, relay_dir, cfg.max_connections)
            relay_args = relay.inner_args(_RELAY_DIR)
            shutil.copy(INNER_RELAY, relay_dir / "relay.py")
        fds = {"info": info_w, "seccomp": seccomp_fd}
        spec = {
            "parent": os.getpid(),
            "status_fd": status_w,
            "stage_dir": str(run_dir / "stage"),
            "disk_bytes": cfg.disk_mb << 20,
            "inodes": max(4096, cfg.disk_mb * 256),
            "trees": trees,
            "ro_binds": ro_binds,
            "uid": uid,
            "cgroup_procs": [str(p) for p in cgroups.join_paths()] if cgroups is not None else [],
            "rlimits": rlimits(cfg, cgroups),
            # What bwrap may inherit; the helper closes the rest (the host directories above all).
            "keep_fds": [info_w, seccomp_fd],
            "bwrap": bwrap_argv(argv, cfg, env or {}, fds, relay_args, ro, staged, str(relay_dir)),
        }
        cmd = [*helper_argv(uid), json.dumps(spec)]
        return _supervise(cmd, cfg, cgroups, info_r, status_r, passed, stdin)
    finally:
        for fd in [info_r, status_r, *passed]:
            with contextlib.suppress(OSError):
                os.close(fd)
        if relay is not None:
            relay.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        if cgroups is not None:
            cgroups.remove()


def _supervise(
    cmd: list[str],
    cfg: SandboxConfig,
    cgroups: Cgroups | None,
    info_r: int,
    status_r: int,
    passed: list[int],
    stdin: str | bytes | None,
) -> SandboxResult:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(passed),
            env=_HELPER_ENV,
            start_new_session=True,  # our terminal's signals are not the sandbox's business
        )
    finally:
        # The helper has its copies; ours would keep the pipes from ever reading end-of-file.
        for fd in passed:
            with contextlib.suppress(OSError):
                os.close(fd)
        passed.clear()
    drains = [_Drain(proc.stdout, cfg.max_output_bytes), _Drain(proc.stderr, cfg.max_output_bytes)]
    for d in drains:
        d.start()
    if stdin is not None:
        threading.Thread(target=_feed, args=(proc, stdin), daemon=True).start()
    init_pid = None
    try:
        # The copy into the sandbox comes first: allow for it (it is bounded by disk_mb).
        init_pid = _read_child_pid(info_r, start + 10.0 + cfg.disk_mb / 100)
        reason, peak_tasks, cpu = _watch(proc, cfg, cgroups, init_pid, start)
        if reason is not None:
            _kill(proc, init_pid)
        rc = _wait_copied_out(proc, init_pid)
    except BaseException:
        # Interrupted (Ctrl-C, an error here): the sandbox must not outlive its supervisor.
        _kill(proc, init_pid, now=True)
        raise
    for d in drains:
        d.join(timeout=5.0)
    status = _read_status(status_r)
    if status.get("error") and init_pid is None:
        raise ValueError(f"run_sandboxed: {status['error']}")
    if cgroups is not None and cgroups.cpu_seconds() is not None:
        cpu = max(cpu, cgroups.cpu_seconds() or 0.0)
    elif "cpu_seconds" in status:
        cpu = max(cpu, float(status["cpu_seconds"]))
    notes = tuple(status.get("notes", ()))
    if status.get("error"):
        notes += (status["error"],)
    stderr = drains[1].text()
    if reason is None:
        reason = _after_the_fact(rc, stderr, cfg, cgroups, cpu, bool(status.get("disk_full")))
    return SandboxResult(
        returncode=rc if rc >= 0 else 128 - rc,
        stdout=drains[0].text(),
        stderr=stderr,
        wall_seconds=time.monotonic() - start,
        timed_out=reason == "wall",
        killed_reason=reason,
        peak_procs=peak_tasks,
        cgroups=cgroups is not None,
        cpu_seconds=round(cpu, 3),
        notes=notes,
    )


def _read_status(fd: int) -> dict:
    """The helper's report (it has exited: every write end is closed)."""
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {}


def _watch(
    proc: subprocess.Popen, cfg: SandboxConfig, cgroups: Cgroups | None, init_pid: int | None, start: float
) -> tuple[str | None, int, float]:
    """Poll the running sandbox until it ends or a limit is reached.

    Returns (the limit reached or None, most tasks seen at once, the tree's CPU seconds so far).
    """
    ns = procs.pid_namespace(init_pid) if init_pid else None
    peak_tasks, cpu = 0, 0.0
    while proc.poll() is None:
        reason = None
        if time.monotonic() - start > cfg.wall_seconds:
            reason = "wall"
        elif ns is not None:
            # The pids cgroup lists the tree directly; without one, scan /proc for the namespace.
            members = cgroups.pids() if cgroups is not None else procs.members(ns)
            tasks, rss, tree_cpu = procs.usage(members)
            acct = cgroups.cpu_seconds() if cgroups is not None else None
            peak_tasks, cpu = max(peak_tasks, tasks), max(cpu, acct if acct is not None else tree_cpu)
            # At the process limit forks are already failing; end the run rather than let a fork
            # bomb spin until the wall clock. The -1 leaves room for a sample taken mid-retry.
            if tasks >= cfg.max_procs - 1 or (cgroups is not None and cgroups.procs_hit()):
                reason = "procs"
            elif cpu > cfg.cpu_seconds:
                reason = "cpu"
            elif cgroups is None and rss > cfg.memory_mb * 1024 * 1024:  # the tree (RLIMIT_AS is per process)
                reason = "memory"
        if reason is not None:
            return reason, peak_tasks, cpu
        # Fast at first (short commands, fork bombs), then easier on a host running many sandboxes;
        # a run that ends meanwhile is seen at once (its pidfd becomes readable).
        _wait_exit(proc, _POLL_S if time.monotonic() - start < 2.0 else 4 * _POLL_S)
    return None, peak_tasks, cpu


def _wait_exit(proc: subprocess.Popen, timeout: float) -> None:
    """Sleep `timeout` seconds or until `proc` exits, whichever is first."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):  # exited and reaped, or a kernel before 5.3
        time.sleep(timeout)
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def _kill(proc: subprocess.Popen, init_pid: int | None, now: bool = False) -> None:
    """SIGKILL the namespace's init, which ends everything in it; the helper then copies the trees
    out and exits. Without an init yet (still staging), or `now`, the helper's group goes too."""
    if init_pid is not None:
        procs.kill_namespace(init_pid)
    if init_pid is None or now:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_copied_out(proc: subprocess.Popen, init_pid: int | None) -> int:
    try:
        return proc.wait(timeout=_COPY_OUT_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill(proc, init_pid, now=True)
        return proc.wait()


def _after_the_fact(
    rc: int, stderr: str, cfg: SandboxConfig, cgroups: Cgroups | None, cpu: float, disk_full: bool
) -> str | None:
    """Which limit ended a run that ended by itself (a limit made something in it fail or die)."""
    if cgroups is not None:
        if cgroups.memory_hit():
            return "memory"
        if cgroups.procs_hit():
            return "procs"
    elif rc != 0 and _ALLOC_FAILED.search(stderr):
        return "memory"
    # SIGXCPU at a process's soft limit, or the tree's budget spent between two samples.
    if rc in (128 + signal.SIGXCPU, -signal.SIGXCPU) or (rc != 0 and cpu >= cfg.cpu_seconds):
        return "cpu"
    if rc != 0 and disk_full:
        return "disk"
    return None


def _feed(proc: subprocess.Popen, data: str | bytes) -> None:
    try:
        proc.stdin.write(data.encode() if isinstance(data, str) else data)
        proc.stdin.close()
    except OSError:
        pass  # the command did not read it all
