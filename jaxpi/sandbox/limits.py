"""Resource limits: rlimits set in the launcher child, and cgroup v1 memory + pids when available.

RLIMIT_NPROC counts per (user namespace, uid): every sandbox has its own user namespace, so the
limit is the number of processes (threads) of that sandbox alone, and it holds even when the host
caller is root... except that the kernel exempts host uid 0 everywhere, so a root caller's sandbox
runs as an unprivileged host uid (`SandboxConfig.host_uid`) when there is no pids cgroup. It is set inside the sandbox
(`nproc_argv`), after the namespace exists, so the caller's own process count never enters it. RLIMIT_AS caps each process's
address space; it is only used when no memory cgroup can be made, because a cgroup limits the
tree as a whole and reports its OOM kills (which lets the result say "memory" for certain).
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
    """A fresh v1 memory cgroup and pids cgroup for one run, removed by `remove()`."""

    def __init__(self, memory_dir: Path, pids_dir: Path) -> None:
        self.memory_dir, self.pids_dir = memory_dir, pids_dir

    @classmethod
    def create(cls, cfg: SandboxConfig) -> Cgroups | None:
        mem, pids = _own_v1_dir("memory"), _own_v1_dir("pids")
        if mem is None or pids is None:
            return None
        # One pair per run, uniquely named: concurrent sandboxes never share a budget.
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
            for d in made:
                with contextlib.suppress(OSError):
                    d.rmdir()
            return None
        return cls(mem / name, pids / name)

    def join_paths(self) -> list[Path]:
        return [self.memory_dir / "cgroup.procs", self.pids_dir / "cgroup.procs"]

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

    # v1 cgroup.procs lists thread-group ids; threads are counted from /proc by the monitor.
    def pids(self) -> list[int]:
        return [int(p) for p in self._read(self.pids_dir / "cgroup.procs").split()]

    def remove(self) -> None:
        # The tree was killed but its last processes may still be exiting: retry for a moment.
        for d in (self.memory_dir, self.pids_dir):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def launch_prefix(cfg: SandboxConfig, cgroups: Cgroups | None) -> list[str]:
    """The commands bwrap is started through: join the cgroups, then set the rlimits and exec.

    Plain processes rather than a `preexec_fn`: code between fork and exec is unsafe in a
    threaded caller (the rollout runner is one), and these are inherited by everything inside.
    """
    limits = [f"--cpu={cfg.cpu_seconds}:{cfg.cpu_seconds + 1}", "--core=0"]  # SIGXCPU, then SIGKILL
    if cgroups is None:
        limits.append(f"--as={cfg.memory_mb * 1024 * 1024}")
    prefix = ["prlimit", *limits, "--"]
    if cgroups is not None:
        join = 'for cg in "$@"; do [ "$cg" = -- ] && { shift; break; }; echo $$ > "$cg" || exit 125; shift; done; exec "$@"'
        prefix = ["/bin/sh", "-c", join, "jaxpi-launch", *map(str, cgroups.join_paths()), "--", *prefix]
    return prefix


def nproc_argv(cfg: SandboxConfig) -> list[str]:
    """The prefix that sets RLIMIT_NPROC inside the sandbox before the command runs."""
    return ["prlimit", f"--nproc={cfg.max_procs}:{cfg.max_procs}", "--"]
