"""Outputs written atomically, with the user's permissions, and cleaned after a killed run.

`atomic_dir(out)` hands out a hidden temporary directory beside `out`,

    .NAME.partial-<host>-<pid>-<start>-XXXXXXXX

and, when the block ends normally, gives it the mode a plain `mkdir` would have (0o777 less the
umask; `mkdtemp` makes 0700, which a server running as another user, e.g. vLLM in a container,
cannot read) and renames it to `out`. An exception removes it. An existing `out` is moved aside to
`.NAME.old-<host>-<pid>-<start>-XXXXXXXX/NAME` first and deleted only once the new one is in place.

A run killed outright (SIGKILL, power loss) leaves those hidden directories behind; the next
`atomic_dir` for the same `out` removes the ones whose writer is gone: same host, and its process
id no longer names a live process started at the recorded time (process ids are reused, start
times are not). A `.old-` directory of a dead writer whose `out` is missing holds the previous
output, interrupted between the two renames: it is put back at `out`. Nothing that looks complete
is ever left at `out` by an interrupted run. Directories of the same pattern without owner fields
(written before owners were recorded) are removed once nothing in them changed for an hour.

`atomic_file(path)` is the same for one file (temporary `.NAME.partial-...` beside it, created
with the umask's mode, renamed into place).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

LEGACY_QUIET_S = 3600.0  # an owner-less leftover untouched this long is not being written


def umask() -> int:
    """The process umask (read without changing it where Linux allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: the classic read-by-setting (restored at once)
    os.umask(mask)
    return mask


def dir_mode() -> int:
    """What `mkdir` would create: 0o777 less the umask."""
    return 0o777 & ~umask()


def file_mode() -> int:
    """What `open(..., "w")` would create: 0o666 less the umask."""
    return 0o666 & ~umask()


def _start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of a live process, None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22; comm may hold spaces
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:  # no /proc: liveness only
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def _host() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _owner() -> str:
    pid = os.getpid()
    return f"{_host()}-{pid}-{_start_time(pid) or 0}"


def _temp_dir(out: Path, kind: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{_owner()}-", dir=out.parent))


# The name after `.NAME.partial` / `.NAME.old`: our owner fields and mkdtemp's 8 random characters,
# or (directories written before owners were recorded) the random characters alone.
_OWNED = re.compile(r"-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-[a-z0-9_]{8}")
_LEGACY = re.compile(r"-[a-z0-9_]{8}")


def _newest_mtime(p: Path) -> float:
    newest = p.lstat().st_mtime
    if p.is_dir() and not p.is_symlink():
        for root, dirs, files in os.walk(p):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _abandoned(leftover: Path, suffix: str) -> bool:
    """Whether the writer of a leftover temp directory is gone (see the module docstring)."""
    m = _OWNED.fullmatch(suffix)
    if m:
        if m["host"] != _host():
            return False  # another machine's writer on a shared filesystem: cannot tell
        pid, start = int(m["pid"]), int(m["start"])
        alive = _start_time(pid)
        return alive is None or (start != 0 and alive not in (0, start))
    if _LEGACY.fullmatch(suffix):
        try:
            return time.time() - _newest_mtime(leftover) > LEGACY_QUIET_S
        except OSError:
            return False
    return False


def clean_stale(out: str | os.PathLike) -> list[Path]:
    """Remove the temporary siblings of `out` left by killed writers (restoring an interrupted
    overwrite's previous `out`); returns what was removed or restored."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    done = []
    for kind in ("old", "partial"):  # an interrupted overwrite's previous output first
        prefix = f".{out.name}.{kind}-"
        for p in sorted(out.parent.iterdir()):
            if not p.name.startswith(prefix) or not _abandoned(p, p.name[len(prefix) - 1 :]):
                continue
            if kind == "old" and p.is_dir() and (p / out.name).exists() and not os.path.lexists(out):
                os.replace(p / out.name, out)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            done.append(p)
    return done


def swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; an existing `out` is moved aside first and deleted only
    once the new one is in place, so no moment leaves neither (or a half-deleted one) at `out`."""
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    old = _temp_dir(out, "old") / out.name
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        shutil.rmtree(old.parent, ignore_errors=True)
        raise
    shutil.rmtree(old.parent, ignore_errors=True)


def refuse_existing(out: str | os.PathLike, *, overwrite: bool = False) -> None:
    """FileExistsError if `out` exists and is not an empty directory, unless `overwrite` (the
    check `atomic_dir` makes; a caller with slow work before its write makes it up front)."""
    out = Path(out)
    if os.path.lexists(out) and not overwrite and (not out.is_dir() or any(out.iterdir())):
        # The commands that write through here (convert, export) take --overwrite for `overwrite`.
        raise FileExistsError(f"{out} exists and is not empty; give --overwrite to replace it")


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Write a directory atomically: `with atomic_dir(out) as tmp:` fill `tmp`; see the module
    docstring. An existing non-empty `out` is a FileExistsError unless `overwrite`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    refuse_existing(out, overwrite=overwrite)
    tmp = _temp_dir(out, "partial")
    try:
        yield tmp
        os.chmod(tmp, dir_mode())
        swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def scratch_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A working directory beside `out` for an output built in steps (e.g. a merge, then its
    quantization): named as `atomic_dir`'s temporaries, so the next write of `out` removes it if
    this process is killed, and removed when the block ends, however it ends."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = _temp_dir(out, "partial")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Write one file atomically: `with atomic_file(path) as f: f.write(...)`; the file gets the
    umask's permissions (not mkstemp's 0600) and replaces `path` only when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.partial-{_owner()}-", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """`path.write_text(text)`, atomically (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(text)
    return Path(path)
