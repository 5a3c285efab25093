"""What a sandboxed run may do (`SandboxConfig`) and what came of it (`SandboxResult`).

The limits are per run, for the whole process tree the command starts:

    cpu_seconds      CPU time of the whole tree, every process that ever ran in it (a cpuacct cgroup's
                     usage where one can be made, else the tree's times in /proc, children's included),
                     enforced by the supervisor; RLIMIT_CPU at the same value is each process's backstop
    cpus             CPUs the tree may keep busy at once (a cpu cgroup's CFS quota; none without one)
    memory_mb        memory of the tree (a memory cgroup where one can be made, else RLIMIT_AS per process)
    max_procs        processes/threads alive at once (RLIMIT_NPROC in the sandbox's own user namespace,
                     plus a pids cgroup where one can be made)
    disk_mb          the workspace and the writable mounts together: they are copies on a tmpfs of
                     this size (so it is memory, and counted by the memory cgroup as it is written),
                     copied back to the host directories when the run ends
    wall_seconds     wall clock; at the limit the sandbox's pid namespace is killed, everything in it dies
    max_connections  connections to the endpoints carried at once; more are refused

`endpoints` are the only network destinations: each `(host, port)` appears inside the sandbox as
`127.0.0.1:port` (see `jaxpi.sandbox.relay`). Everything else, other loopback ports included, is
unreachable: the sandbox has its own network namespace with nothing but a loopback device.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

# "disk": the run failed with its disk quota full (the file system refused writes; nothing killed it).
KILL_REASONS = ("wall", "memory", "cpu", "procs", "disk")


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    cpu_seconds: int = 60
    memory_mb: int = 2048
    max_procs: int = 256
    wall_seconds: float = 120.0
    disk_mb: int = 1024
    cpus: float = 1.0
    max_connections: int = 64
    # (host, port) pairs reachable from inside at 127.0.0.1:port; the policy endpoint goes here.
    endpoints: tuple[tuple[str, int], ...] = ()
    # Extra host paths bound read-only at the same path inside (e.g. a toolchain outside /usr).
    ro_binds: tuple[str, ...] = ()
    # Where the workspace appears inside; the command starts there.
    workspace_mount: str = "/workspace"
    # None: use cgroups (v1 memory + pids) when this process may create them, else rlimits only.
    use_cgroups: bool | None = None
    max_output_bytes: int = 1 << 20  # stdout / stderr kept per stream (the rest is dropped)
    tmp_mb: int = 256  # size of the private /tmp (a tmpfs, i.e. memory)
    # A root caller's sandbox always runs as this host uid/gid (the staged copies of the workspace
    # belong to it); a caller that is not root runs it as itself. Best a uid nothing else uses.
    host_uid: int = 65534

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mb", "max_procs", "disk_mb", "max_connections"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive integer, got {v!r}")
        # bwrap's init, the launch shell and the relay take a few slots before the command runs.
        if self.max_procs < 4:
            raise ValueError(
                f"SandboxConfig.max_procs must be >= 4 (the shell and sandbox init), got {self.max_procs}"
            )
        if (
            isinstance(self.cpus, bool)
            or not isinstance(self.cpus, (int, float))
            or not 0.01 <= self.cpus <= 1024
        ):
            raise ValueError(
                f"SandboxConfig.cpus must be a number of CPUs in [0.01, 1024], got {self.cpus!r}"
            )
        if not self.wall_seconds > 0:
            raise ValueError(f"SandboxConfig.wall_seconds must be > 0, got {self.wall_seconds!r}")
        if self.tmp_mb <= 0 or self.host_uid <= 0:
            raise ValueError(
                f"SandboxConfig.tmp_mb and host_uid must be > 0, got {self.tmp_mb}, {self.host_uid}"
            )
        if self.max_output_bytes <= 0:
            raise ValueError(f"SandboxConfig.max_output_bytes must be > 0, got {self.max_output_bytes}")
        ports = set()
        for ep in self.endpoints:
            if not (
                isinstance(ep, tuple) and len(ep) == 2 and isinstance(ep[0], str) and isinstance(ep[1], int)
            ):
                raise ValueError(f"SandboxConfig.endpoints entries must be (host, port), got {ep!r}")
            # Inside, the relay binds 127.0.0.1:port without capabilities: no privileged ports.
            if not 1024 <= ep[1] < 65536:
                raise ValueError(f"SandboxConfig.endpoints: port must be in 1024..65535 in {ep!r}")
            if ep[1] in ports:
                raise ValueError(
                    f"SandboxConfig.endpoints: port {ep[1]} given twice (inside, each is 127.0.0.1:port)"
                )
            ports.add(ep[1])
        for p in self.ro_binds:
            if not Path(p).is_absolute():
                raise ValueError(f"SandboxConfig.ro_binds must be absolute paths, got {p!r}")
        if not Path(self.workspace_mount).is_absolute() or self.workspace_mount in (
            "/",
            "/usr",
            "/etc",
            "/proc",
            "/dev",
            "/tmp",
        ):
            raise ValueError(
                f"SandboxConfig.workspace_mount must be an absolute path of its own, got {self.workspace_mount!r}"
            )

    def replace(self, **kw: object) -> SandboxConfig:
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    returncode: int  # the command's exit status; 128 + signal when a signal ended it
    stdout: str
    stderr: str
    wall_seconds: float
    timed_out: bool  # the wall clock ran out
    killed_reason: str | None  # None or one of KILL_REASONS: which limit ended (or stopped) the run
    peak_procs: int = 0  # most processes seen alive at once by the monitor
    cgroups: bool = False  # whether memory / pids were enforced by cgroups on this run
    cpu_seconds: float = 0.0  # CPU time the whole tree used
    notes: tuple[str, ...] = ()  # what the copy back out left out (special files, over the quota)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
