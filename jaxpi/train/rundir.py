"""A run directory that a failed start leaves as it found it.

    with new_paths(cfg.output.dir) as made:
        ...set up: config.json, checkpoints/, the base...
        ...first step...
        made.keep()          # from here on the run has something worth resuming

A trainer that fails before its first step (a missing base, bad data, a wrong tokenizer) would
otherwise leave `config.json`, an empty `checkpoints/` and maybe a built base behind, and the next
run in that directory would be checked against them. On an exception before `keep()`, what this
run added is removed: the top-level entries of the directory that were not there before, the
directory itself when this run made it, and the parent directories it made (when empty). What
was there before is never touched, so a resumed run that fails keeps its checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class NewPaths:
    """What a run adds to `run_dir`, recorded before it writes anything."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.dir = Path(run_dir).absolute()
        # The highest ancestor (or the dir itself) that does not exist yet: the run makes it.
        missing = [p for p in (self.dir, *self.dir.parents) if not os.path.lexists(p)]
        self.made: list[Path] = missing  # deepest first
        self.before = set(os.listdir(self.dir)) if self.dir.is_dir() else set()
        self.kept = False

    def keep(self) -> None:
        """The run has done a step: a later failure leaves its directory for a resume."""
        self.kept = True

    def remove(self) -> None:
        """Remove what was added since this object was made (a no-op after `keep`)."""
        if self.kept:
            return
        if self.made:
            shutil.rmtree(self.dir, ignore_errors=True)
            for parent in self.made[1:]:
                with contextlib.suppress(OSError):  # another process may have put something there
                    parent.rmdir()
            return
        if not self.dir.is_dir():
            return
        for name in set(os.listdir(self.dir)) - self.before:
            path = self.dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


@contextlib.contextmanager
def new_paths(run_dir: str | os.PathLike) -> Iterator[NewPaths]:
    """`NewPaths(run_dir)`, removed when the block raises before `keep()`."""
    made = NewPaths(run_dir)
    try:
        yield made
    except BaseException:
        made.remove()
        raise
