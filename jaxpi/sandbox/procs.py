"""The sandbox's processes as the host sees them: everything in its pid namespace."""

from __future__ import annotations

import contextlib
import os
import signal


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


# A pid namespace is identified by the inode behind /proc/PID/ns/pid: equal links, same namespace.
def members(namespace: str) -> list[int]:
    """Host pids of all live processes in the pid namespace `namespace` (a `pid:[inode]` link)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == namespace:
                    out.append(int(name))
            except OSError:
                continue  # exited, or not ours to inspect
    return out


def usage(pids: list[int]) -> tuple[int, int, float]:
    """(tasks, resident bytes, most CPU seconds of one process) over `pids`; gone pids count 0."""
    tasks = rss = 0
    cpu = 0.0
    page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            tasks += len(os.listdir(f"/proc/{pid}/task"))
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * page
            with open(f"/proc/{pid}/stat") as f:
                # Fields after the parenthesised command name; utime, stime are the 12th and 13th.
                fields = f.read().rsplit(")", 1)[1].split()
            cpu = max(cpu, (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return tasks, rss, cpu


def kill_namespace(init_pid: int) -> None:
    """SIGKILL the namespace's init: the kernel then kills every process in the namespace."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(init_pid, signal.SIGKILL)
