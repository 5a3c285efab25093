"""A task directory (in the spirit of Harbor / Terminal-Bench tasks) and its loader.

    my-task/
      instruction.md        what the agent is told
      task.toml             [metadata] id, category, difficulty, tags
                            [limits] wall_seconds, max_turns, max_tokens (+ optional memory_mb, max_procs,
                                     cpu_seconds, disk_mb)
                            [verifier] timeout (seconds)
      environment/          initial workspace files (optional; copied into a fresh workspace per attempt)
      tests/test.sh         the verifier: run in the sandbox against the workspace; exit 0 = pass
      solution/solve.sh     the oracle: run in a fresh workspace, after which the verifier must pass

Inside the sandbox the workspace is the working directory, a copy of the task's tests is at
/tests and of the solution at /solution, both read-only (never in the workspace the agent sees).
Every loader error names the task directory and the file or field at fault.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

DIFFICULTIES = ("easy", "medium", "hard")
_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")


class TaskError(ValueError):
    """A task directory that does not follow the format; the message names the dir and the field."""


@dataclasses.dataclass(frozen=True)
class TaskLimits:
    wall_seconds: float = 600.0  # a whole attempt (and the oracle)
    max_turns: int = 50
    max_tokens: int = 32768
    memory_mb: int = 1024
    max_procs: int = 128
    cpu_seconds: int = 300  # CPU time of the whole sandbox (every process), not of each process
    disk_mb: int = 1024  # the workspace's disk quota in the sandbox (a tmpfs: memory)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"[limits] {f.name} must be a positive number, got {v!r}")
        for name in ("max_turns", "max_tokens", "memory_mb", "max_procs", "cpu_seconds", "disk_mb"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"[limits] {name} must be an integer, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    path: Path
    instruction: str
    category: str
    difficulty: str
    tags: tuple[str, ...]
    limits: TaskLimits
    verifier_timeout: float
    environment_dir: Path | None  # None: the attempt starts in an empty workspace
    tests_dir: Path
    solution_dir: Path

    def __post_init__(self) -> None:
        if not _ID.fullmatch(self.id):
            raise ValueError(f"[metadata] id must match {_ID.pattern}, got {self.id!r}")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"[metadata] difficulty must be one of {DIFFICULTIES}, got {self.difficulty!r}")
        if not self.instruction.strip():
            raise ValueError("instruction.md is empty")
        if not self.verifier_timeout > 0:
            raise ValueError(f"[verifier] timeout must be > 0, got {self.verifier_timeout!r}")

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "category": self.category,
            "difficulty": self.difficulty,
            "tags": list(self.tags),
            "path": str(self.path),
        }


def _table(doc: dict, name: str, where: Path) -> dict:
    t = doc.get(name, {})
    if not isinstance(t, dict):
        raise TaskError(f"{where}: task.toml [{name}] must be a table")
    return t


def _field(
    table: dict, section: str, key: str, kind: type | tuple[type, ...], where: Path, default: Any = None
) -> Any:
    if key not in table:
        if default is None:
            raise TaskError(f"{where}: task.toml [{section}] is missing {key!r}")
        return default
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise TaskError(
            f"{where}: task.toml [{section}] {key} has the wrong type ({type(v).__name__}: {v!r})"
        )
    return v


def load_task(path: str | Path) -> Task:
    """Read and validate one task directory."""
    d = Path(path).resolve()
    if not d.is_dir():
        raise TaskError(f"{d}: not a task directory")
    for required in ("instruction.md", "task.toml", "tests/test.sh", "solution/solve.sh"):
        if not (d / required).is_file():
            raise TaskError(f"{d}: missing {required}")
    try:
        doc = tomllib.loads((d / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{d}: task.toml is not valid TOML: {e}") from e
    meta = _table(doc, "metadata", d)
    lim = _table(doc, "limits", d)
    ver = _table(doc, "verifier", d)
    # Unknown names are errors: a misspelt limit silently falling back to its default would
    # change what an attempt may do without anyone noticing.
    unknown = set(doc) - {"metadata", "limits", "verifier"}
    if unknown:
        raise TaskError(f"{d}: task.toml has unknown tables {sorted(unknown)}")
    known_limits = {f.name for f in dataclasses.fields(TaskLimits)}
    if set(lim) - known_limits:
        raise TaskError(f"{d}: task.toml [limits] has unknown keys {sorted(set(lim) - known_limits)}")
    tags = _field(meta, "metadata", "tags", list, d, default=[])
    if not all(isinstance(t, str) for t in tags):
        raise TaskError(f"{d}: task.toml [metadata] tags must be a list of strings")
    # In the order of the file: [metadata], [limits], [verifier].
    task_id = _field(meta, "metadata", "id", str, d)
    category = _field(meta, "metadata", "category", str, d)
    difficulty = _field(meta, "metadata", "difficulty", str, d)
    for key in ("wall_seconds", "max_turns", "max_tokens"):
        _field(lim, "limits", key, (int, float), d)
    env = d / "environment"
    try:
        return Task(
            id=task_id,
            path=d,
            instruction=(d / "instruction.md").read_text(),
            category=category,
            difficulty=difficulty,
            tags=tuple(tags),
            limits=TaskLimits(**lim),
            verifier_timeout=float(_field(ver, "verifier", "timeout", (int, float), d)),
            environment_dir=env if env.is_dir() else None,
            tests_dir=d / "tests",
            solution_dir=d / "solution",
        )
    except (ValueError, TypeError) as e:
        if isinstance(e, TaskError):
            raise
        raise TaskError(f"{d}: {e}") from e


def find_task_dirs(root: str | Path) -> list[Path]:
    """`root` itself if it is a task, else every directory below it holding a task.toml (sorted)."""
    r = Path(root)
    if not r.is_dir():
        raise TaskError(f"{r}: no such directory")
    if (r / "task.toml").is_file():
        return [r]
    return sorted(p.parent for p in r.rglob("task.toml"))


def load_tasks(root: str | Path) -> list[Task]:
    """Every task under `root`; ids must be unique."""
    tasks = [load_task(p) for p in find_task_dirs(root)]
    seen: dict[str, Path] = {}
    for t in tasks:
        if t.id in seen:
            raise TaskError(f"{t.path}: task id {t.id!r} is also used by {seen[t.id]}")
        seen[t.id] = t.path
    return tasks
