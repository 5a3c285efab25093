"""Facts about the host machine that callers size their work by."""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int | None:
    """Bytes of memory available now (/proc/meminfo's MemAvailable), or None where it cannot be
    read (no /proc)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
