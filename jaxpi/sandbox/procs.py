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
    """(tasks, resident bytes, CPU seconds) over `pids`; gone pids count 0.

    The CPU seconds are each process's own and those of its children it has waited for: in a pid
    namespace, whose init reaps every orphan, that is all the tree ever used, but for children
    that are reaped without a wait (SIGCHLD ignored), which RLIMIT_CPU still bounds one by one.
    """
    tasks = rss = 0
    cpu = 0.0
    page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            tasks += len(os.listdir(f"/proc/{pid}/task"))
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * page
            with open(f"/proc/{pid}/stat") as f:
                # Fields after the parenthesised command name: utime, stime, cutime, cstime are 12th-15th.
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += sum(int(x) for x in fields[11:15]) / tick
        except (OSError, IndexError, ValueError):
            continue
    return tasks, rss, cpu


def kill_namespace(init_pid: int) -> None:
    """SIGKILL the namespace's init: the kernel then kills every process in the namespace."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(init_pid, signal.SIGKILL)
