"""Resource limits: rlimits set by the staging helper, and v1 cgroups when this process may make them.

cgroups (v1): memory and pids, required together; cpu (bandwidth, `cfg.cpus`) and cpuacct (the
tree's CPU time, for the run's CPU budget) where the host mounts them.

RLIMIT_NPROC counts per (user namespace, uid): every sandbox has its own user namespace, so the
limit is the number of processes (threads) of that sandbox alone. The kernel exempts host uid 0,
which is one reason a root caller's sandbox always runs as the unprivileged host uid
`SandboxConfig.host_uid`. It is set inside the sandbox (`nproc_argv`), after the namespace exists,
so the caller's own process count never enters it. RLIMIT_AS caps each process's address space;
it is only used when no memory cgroup can be made, because a cgroup limits the tree as a whole
and reports its OOM kills (which lets the result say "memory" for certain).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path

from jaxpi.sandbox.config import SandboxConfig

_V1_ROOT = Path("/sys/fs/cgroup")


def _own_v1_dir(controller: str) -> Path | None:
    """This process's cgroup directory for a v1 controller, or None when there is none to use."""
    mount = _V1_ROOT / controller
    if not (mount / "cgroup.procs").exists():
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            own = mount / path.lstrip("/")
            # In a container the mount may already be our own cgroup rather than the host's root.
            return own if own.is_dir() else mount
    return None


class Cgroups:
    """Fresh v1 cgroups for one run (memory and pids; cpu and cpuacct where mounted), removed by
    `remove()`."""

    def __init__(
        self, memory_dir: Path, pids_dir: Path, cpu_dir: Path | None, cpuacct_dir: Path | None
    ) -> None:
        self.memory_dir, self.pids_dir = memory_dir, pids_dir
        self.cpu_dir, self.cpuacct_dir = cpu_dir, cpuacct_dir

    @classmethod
    def create(cls, cfg: SandboxConfig) -> Cgroups | None:
        mem, pids = _own_v1_dir("memory"), _own_v1_dir("pids")
        if mem is None or pids is None:
            return None
        # One set per run, uniquely named: concurrent sandboxes never share a budget.
        name = f"jaxpi-sandbox-{uuid.uuid4().hex[:12]}"
        made: list[Path] = []
        try:
            for parent in (mem, pids):
                (parent / name).mkdir()
                made.append(parent / name)
            limit = cfg.memory_mb * 1024 * 1024
            (mem / name / "memory.limit_in_bytes").write_text(str(limit))
            memsw = mem / name / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # swap accounting on: the limit covers swap too
                memsw.write_text(str(limit))
            (pids / name / "pids.max").write_text(str(cfg.max_procs))
        except OSError:
            _rmdirs(made)
            return None
        cpu, cpuacct = _cpu_dirs(cfg, name)
        return cls(mem / name, pids / name, cpu, cpuacct)

    def join_paths(self) -> list[Path]:
        dirs = [self.memory_dir, self.pids_dir, self.cpu_dir, self.cpuacct_dir]
        return [d / "cgroup.procs" for d in dict.fromkeys(d for d in dirs if d is not None)]

    def _read(self, path: Path) -> str:
        try:
            return path.read_text()
        except OSError:
            return ""

    def memory_hit(self) -> bool:
        """An OOM kill happened in the group (or the limit refused a charge)."""
        for line in self._read(self.memory_dir / "memory.oom_control").splitlines():
            key, _, val = line.partition(" ")
            if key == "oom_kill" and int(val or 0) > 0:
                return True
        return int(self._read(self.memory_dir / "memory.failcnt") or 0) > 0

    def procs_hit(self) -> bool:
        """A fork was refused at pids.max."""
        for line in self._read(self.pids_dir / "pids.events").splitlines():
            key, _, val = line.partition(" ")
            if key == "max" and int(val or 0) > 0:
                return True
        return False

    def cpu_seconds(self) -> float | None:
        """CPU time of everything that ever ran in the group (cpuacct.usage), or None without it."""
        if self.cpuacct_dir is None:
            return None
        raw = self._read(self.cpuacct_dir / "cpuacct.usage").strip()
        return int(raw) / 1e9 if raw.isdigit() else None

    # v1 cgroup.procs lists thread-group ids; threads are counted from /proc by the monitor.
    def pids(self) -> list[int]:
        return [int(p) for p in self._read(self.pids_dir / "cgroup.procs").split()]

    def remove(self) -> None:
        # The tree was killed but its last processes may still be exiting: retry for a moment.
        dirs = [self.memory_dir, self.pids_dir, self.cpu_dir, self.cpuacct_dir]
        for d in dict.fromkeys(d for d in dirs if d is not None):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def _rmdirs(dirs: list[Path]) -> None:
    for d in dirs:
        with contextlib.suppress(OSError):
            d.rmdir()


_CFS_PERIOD_US = 100_000


def _cpu_dirs(cfg: SandboxConfig, name: str) -> tuple[Path | None, Path | None]:
    """The run's cpu cgroup (bandwidth: `cfg.cpus` CPUs) and cpuacct cgroup (usage), where the
    host has them (None where not); the two are one directory where co-mounted."""
    quota = max(1000, int(cfg.cpus * _CFS_PERIOD_US))
    cpu = _make(_own_v1_dir("cpu"), name, {"cpu.cfs_period_us": _CFS_PERIOD_US, "cpu.cfs_quota_us": quota})
    parent = _own_v1_dir("cpuacct")
    if parent is not None and cpu is not None and (parent / name).resolve() == cpu.resolve():
        return cpu, cpu if (cpu / "cpuacct.usage").exists() else None
    acct = _make(parent, name, {})
    if acct is not None and not (acct / "cpuacct.usage").exists():
        _rmdirs([acct])
        acct = None
    return cpu, acct


def _make(parent: Path | None, name: str, settings: dict[str, int]) -> Path | None:
    if parent is None:
        return None
    d = parent / name
    try:
        d.mkdir()
        for key, value in settings.items():
            (d / key).write_text(str(value))
    except OSError:
        _rmdirs([d])
        return None
    return d


def rlimits(cfg: SandboxConfig, cgroups: Cgroups | None) -> dict[str, tuple[int, int]]:
    """The rlimits bwrap and everything in the sandbox inherit (set by the staging helper).

    RLIMIT_CPU is per process, a backstop under the run's CPU budget, which the supervisor
    enforces over the whole tree: SIGXCPU at the limit, SIGKILL a second later.
    """
    lim = {"cpu": (cfg.cpu_seconds, cfg.cpu_seconds + 1), "core": (0, 0)}
    if cgroups is None:
        lim["as"] = (cfg.memory_mb * 1024 * 1024,) * 2
    return lim


def nproc_argv(cfg: SandboxConfig) -> list[str]:
    """The prefix that sets RLIMIT_NPROC inside the sandbox before the command runs."""
    return ["prlimit", f"--nproc={cfg.max_procs}:{cfg.max_procs}", "--"]
