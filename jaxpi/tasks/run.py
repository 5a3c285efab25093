"""Running a task's parts in the sandbox: a fresh workspace, the oracle, the verifier.

The later attempt runner (Pi in the sandbox) and the audit share these, so an attempt is scored
exactly as the audit checked the task: `bash /tests/test.sh` in the workspace, exit 0 = pass.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from jaxpi.sandbox import SandboxConfig, SandboxResult, run_sandboxed
from jaxpi.tasks.task import Task


@contextlib.contextmanager
def workspace_root(prefix: str = "jaxpi-ws-") -> Iterator[Path]:
    """A temporary directory for workspaces, searchable by others (an unprivileged sandbox uid
    must reach them when the caller is root; see `jaxpi.sandbox.bwrap`), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        root.chmod(0o711)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def new_workspace(task: Task, root: Path) -> Path:
    """A fresh workspace under `root` holding a copy of the task's environment/ (or nothing)."""
    ws = Path(tempfile.mkdtemp(prefix=f"{task.id}-", dir=root))
    if task.environment_dir is not None:
        # Symlinks stay links: a task may ship one, and following it could copy host files in.
        shutil.copytree(task.environment_dir, ws, symlinks=True, dirs_exist_ok=True)
    return ws


def sandbox_config(task: Task, wall_seconds: float) -> SandboxConfig:
    lim = task.limits
    return SandboxConfig(
        cpu_seconds=lim.cpu_seconds,
        memory_mb=lim.memory_mb,
        max_procs=lim.max_procs,
        wall_seconds=wall_seconds,
    )


def run_verifier(task: Task, workspace: Path, cfg: SandboxConfig | None = None) -> SandboxResult:
    """The task's tests/test.sh against `workspace`; the tests are read-only at /tests."""
    cfg = cfg or sandbox_config(task, task.verifier_timeout)
    return run_sandboxed(["bash", "/tests/test.sh"], workspace, cfg, mounts={"/tests": task.tests_dir})


def run_oracle(task: Task, workspace: Path, cfg: SandboxConfig | None = None) -> SandboxResult:
    """The task's solution/solve.sh in `workspace`; the solution is read-only at /solution."""
    cfg = cfg or sandbox_config(task, task.limits.wall_seconds)
    return run_sandboxed(
        ["bash", "/solution/solve.sh"], workspace, cfg, mounts={"/solution": task.solution_dir}
    )
