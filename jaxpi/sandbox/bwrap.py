"""Run one command under bubblewrap: read-only system, writable workspace, no network, limits.

    result = run_sandboxed(["bash", "-lc", "make test"], workspace, SandboxConfig(wall_seconds=30))

Inside, the command sees: /usr (and the /bin, /lib* links), /etc read-only (shadow files masked),
the workspace read-write at `cfg.workspace_mount` (its working directory), a private tmpfs /tmp,
its own /proc and a minimal /dev; the root itself is read-only and nothing else of the host is
mounted (so neither the checkout nor $HOME exists in there). Every namespace is new: user (no
capabilities), pid, network (loopback only), ipc, uts, cgroup. The host watches the sandbox's pid
namespace while it runs and kills its init, which ends every process in it, at the wall limit or
when the process limit is reached. See `jaxpi.sandbox.config` for the limits and
`jaxpi.sandbox.relay` for the one way out (the allowed endpoints).
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
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxpi.sandbox import procs
from jaxpi.sandbox.config import SandboxConfig, SandboxResult
from jaxpi.sandbox.limits import Cgroups, launch_prefix, nproc_argv
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
# Only consulted without a memory cgroup: with RLIMIT_AS an allocation fails rather than being
# killed, and this is how the usual runtimes say so.
_ALLOC_FAILED = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")
_POLL_S = 0.03


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
    mounts: Mapping[str, Path] | None = None,
    rw_mounts: Mapping[str, Path] | None = None,
) -> list[str]:
    """The full bwrap command line (pure but for a look at the host's top-level directories).

    `fds`: open descriptors for "info" (bwrap's --info-fd), "workspace" and, with endpoints,
    "relay_dir" (holding the sockets and the relay script). Descriptors pin the very directories
    that were checked, whatever happens to their paths meanwhile.
    """
    bw = bwrap_path() or "bwrap"
    args = [bw, "--unshare-all", "--unshare-user", "--disable-userns"]
    args += ["--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID), "--hostname", "sandbox"]
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    args += system_binds()
    # The private /tmp comes before the binds: a bound path under /tmp (a checkout or a toolchain
    # living there) is then mounted on top of the tmpfs instead of being hidden by it.
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(cfg.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]
    for path in cfg.ro_binds:
        args += ["--ro-bind", path, path]
    for inside, host in (mounts or {}).items():
        args += ["--ro-bind", str(host), inside]
    for inside, host in (rw_mounts or {}).items():
        args += ["--bind", str(host), inside]
    args += ["--bind-fd", str(fds["workspace"]), cfg.workspace_mount, "--chdir", cfg.workspace_mount]
    inner = nproc_argv(cfg)
    if relay_args:
        args += ["--ro-bind-fd", str(fds["relay_dir"]), _RELAY_DIR]
        # The relay binds its ports, forks to the background, and only then does the command start.
        launch = f'python3 {_RELAY_DIR}/relay.py {" ".join(relay_args)} && exec "$@"'
        inner += ["/bin/sh", "-c", launch, "sandbox"]
    args += ["--remount-ro", "/", "--clearenv"]
    for k, v in {**BASE_ENV, **env}.items():
        args += ["--setenv", k, v]
    args += ["--info-fd", str(fds["info"]), "--"]
    return args + inner + list(argv)


def _check_reachable(ws: Path) -> None:
    for parent in ws.parents:
        if not parent.stat().st_mode & 0o001:
            raise ValueError(
                f"run_sandboxed: {parent} is not searchable by others (mode {parent.stat().st_mode & 0o777:o}); "
                f"without cgroups a root caller's sandbox runs as an unprivileged uid, which must reach "
                f"the workspace {ws}: put workspaces under a directory with mode 0711 or 0755"
            )


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            with contextlib.suppress(FileNotFoundError):  # removed while we walked
                os.lchown(os.path.join(dirpath, name), uid, gid)


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

    `mounts` maps paths inside to host paths bound read-only there (a verifier's tests, an oracle);
    `rw_mounts` maps paths inside to host directories bound writable (an agent's config home, kept
    apart from the workspace the verifier sees), handed to the sandbox uid like the workspace.
    """
    cfg = cfg or SandboxConfig()
    if not argv:
        raise ValueError("run_sandboxed: empty argv")
    if bwrap_path() is None:
        raise FileNotFoundError("bwrap not found: install bubblewrap (Debian: apt-get install -y bubblewrap)")
    ws = Path(workspace).resolve()
    if not ws.is_dir():
        raise FileNotFoundError(f"run_sandboxed: workspace {ws} is not a directory")
    cgroups = Cgroups.create(cfg) if cfg.use_cgroups is not False else None
    if cfg.use_cgroups and cgroups is None:
        raise ValueError("SandboxConfig.use_cgroups=True but no v1 memory/pids cgroup could be created here")
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
    # Without a pids cgroup, RLIMIT_NPROC is the process limit, and the kernel never applies it to
    # host root: a root caller's sandbox then runs as the unprivileged cfg.host_uid.
    drop_to = cfg.host_uid if os.geteuid() == 0 and cgroups is None else None
    if drop_to is not None:
        for path in [ws, *ro_mounts.values(), *rw.values()]:
            _check_reachable(path)
    owners = {path: path.stat() for path in [ws, *rw.values()]}
    relay_dir = Path(tempfile.mkdtemp(prefix="jaxpi-relay-")) if cfg.endpoints else None
    relay = None
    info_r, info_w = os.pipe()
    fds = {"info": info_w, "workspace": os.open(ws, os.O_PATH | os.O_DIRECTORY)}
    try:
        relay_args: list[str] = []
        if relay_dir is not None:
            relay_dir.chmod(0o711)  # the sandbox uid must reach the sockets inside
            relay = HostRelay(cfg.endpoints, relay_dir)
            relay_args = relay.inner_args(_RELAY_DIR)
            fds["relay_dir"] = os.open(relay_dir, os.O_PATH | os.O_DIRECTORY)
            shutil.copy(INNER_RELAY, relay_dir / "relay.py")
        if drop_to is not None:
            for path in owners:
                _chown_tree(path, drop_to, drop_to)
        cmd = launch_prefix(cfg, cgroups) + bwrap_argv(argv, cfg, env or {}, fds, relay_args, ro_mounts, rw)
        return _supervise(cmd, cfg, cgroups, info_r, fds, stdin, drop_to)
    finally:
        for fd in [info_r, *fds.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        if drop_to is not None:
            for path, owner in owners.items():
                _chown_tree(path, owner.st_uid, owner.st_gid)
        if relay is not None:
            relay.close()
        if relay_dir is not None:
            shutil.rmtree(relay_dir, ignore_errors=True)
        if cgroups is not None:
            cgroups.remove()


def _supervise(
    cmd: list[str],
    cfg: SandboxConfig,
    cgroups: Cgroups | None,
    info_r: int,
    fds: dict[str, int],
    stdin: str | bytes | None,
    drop_to: int | None,
) -> SandboxResult:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(fds.values()),
            # Done by the C fork helper (no Python runs in the child): the unprivileged uid, if any.
            user=drop_to,
            group=drop_to,
            extra_groups=[] if drop_to is not None else None,
            start_new_session=True,  # our terminal's signals are not the sandbox's business
        )
    finally:
        os.close(fds.pop("info"))
    drains = [_Drain(proc.stdout, cfg.max_output_bytes), _Drain(proc.stderr, cfg.max_output_bytes)]
    for d in drains:
        d.start()
    if stdin is not None:
        threading.Thread(target=_feed, args=(proc, stdin), daemon=True).start()
    init_pid = None
    try:
        init_pid = _read_child_pid(info_r, start + 10.0)
        reason, peak_tasks, peak_cpu = _watch(proc, cfg, cgroups, init_pid, start)
    except BaseException:
        # Interrupted (Ctrl-C, an error here): the sandbox must not outlive its supervisor.
        _kill(proc, init_pid)
        raise
    rc = proc.wait()
    for d in drains:
        d.join(timeout=5.0)
    stderr = drains[1].text()
    if reason is None:
        reason = _after_the_fact(rc, stderr, cfg, cgroups, peak_cpu)
    return SandboxResult(
        returncode=rc if rc >= 0 else 128 - rc,
        stdout=drains[0].text(),
        stderr=stderr,
        wall_seconds=time.monotonic() - start,
        timed_out=reason == "wall",
        killed_reason=reason,
        peak_procs=peak_tasks,
        cgroups=cgroups is not None,
    )


def _watch(
    proc: subprocess.Popen, cfg: SandboxConfig, cgroups: Cgroups | None, init_pid: int | None, start: float
) -> tuple[str | None, int, float]:
    """Poll the running sandbox until it ends or a limit is reached (then kill it).

    Returns (the limit that ended it or None, most tasks seen at once, most CPU seconds of a process).
    """
    ns = procs.pid_namespace(init_pid) if init_pid else None
    peak_tasks, peak_cpu = 0, 0.0
    while proc.poll() is None:
        reason = None
        if time.monotonic() - start > cfg.wall_seconds:
            reason = "wall"
        elif ns is not None:
            # The pids cgroup lists the tree directly; without one, scan /proc for the namespace.
            members = cgroups.pids() if cgroups is not None else procs.members(ns)
            tasks, rss, cpu = procs.usage(members)
            peak_tasks, peak_cpu = max(peak_tasks, tasks), max(peak_cpu, cpu)
            # At the process limit forks are already failing; end the run rather than let a fork
            # bomb spin until the wall clock. The -1 leaves room for a sample taken mid-retry.
            if tasks >= cfg.max_procs - 1 or (cgroups is not None and cgroups.procs_hit()):
                reason = "procs"
            elif cgroups is None and rss > cfg.memory_mb * 1024 * 1024:  # the tree (RLIMIT_AS is per process)
                reason = "memory"
        if reason is not None:
            _kill(proc, init_pid)
            return reason, peak_tasks, peak_cpu
        # Fast at first (short commands, fork bombs), then easier on a host running many sandboxes.
        time.sleep(_POLL_S if time.monotonic() - start < 2.0 else 4 * _POLL_S)
    return None, peak_tasks, peak_cpu


def _kill(proc: subprocess.Popen, init_pid: int | None) -> None:
    """SIGKILL the namespace's init (which ends everything in it) and bwrap's own process group."""
    if init_pid is not None:
        procs.kill_namespace(init_pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _after_the_fact(
    rc: int, stderr: str, cfg: SandboxConfig, cgroups: Cgroups | None, peak_cpu: float
) -> str | None:
    """Which limit ended a run that ended by itself (a limit made something in it fail or die)."""
    if cgroups is not None:
        if cgroups.memory_hit():
            return "memory"
        if cgroups.procs_hit():
            return "procs"
    elif rc != 0 and _ALLOC_FAILED.search(stderr):
        return "memory"
    # SIGXCPU at the soft limit; the last sample of the process was taken within a poll of it.
    if rc in (128 + signal.SIGXCPU, -signal.SIGXCPU) or peak_cpu >= cfg.cpu_seconds - 0.25:
        return "cpu"
    return None


def _feed(proc: subprocess.Popen, data: str | bytes) -> None:
    try:
        proc.stdin.write(data.encode() if isinstance(data, str) else data)
        proc.stdin.close()
    except OSError:
        pass  # the command did not read it all
