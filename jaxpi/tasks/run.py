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
    """A temporary directory for workspaces, removed afterwards (mode 0711: the sandbox copies a
    workspace in and out itself, so this is no longer required, only tidy)."""
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
        disk_mb=lim.disk_mb,
        wall_seconds=wall_seconds,
    )


@contextlib.contextmanager
def staged_copy(src: Path) -> Iterator[Path]:
    """A private copy of the task directory `src` (tests/ or solution/) for one run, removed after.

    What runs is pinned (a task edited meanwhile does not change it) and readable by the
    sandbox's unprivileged uid wherever the task lives and whatever its files' modes: directories
    0755, files 0644 (0755 when the original is executable), owned by the caller. Symlinks stay
    links (pointing wherever they point inside the sandbox, never followed here).
    """
    base = Path(tempfile.mkdtemp(prefix="jaxpi-stage-"))
    try:
        base.chmod(0o711)
        dst = base / src.name
        shutil.copytree(src, dst, symlinks=True)
        for path in [dst, *dst.rglob("*")]:
            if path.is_symlink():
                continue
            if path.is_dir():
                path.chmod(0o755)
            else:
                path.chmod(0o755 if path.stat().st_mode & 0o111 else 0o644)
        yield dst
    finally:
        shutil.rmtree(base, ignore_errors=True)


# The verifier's disk quota over the task's: an attempt that left its workspace full must not make
# the verifier fail for want of room (a "disk" verdict would turn a failure into "not scored").
VERIFIER_DISK_HEADROOM_MB = 256


def run_verifier(task: Task, workspace: Path, cfg: SandboxConfig | None = None) -> SandboxResult:
    """The task's tests/test.sh against `workspace`; a copy of tests/ is read-only at /tests."""
    if cfg is None:
        cfg = sandbox_config(task, task.verifier_timeout)
        cfg = cfg.replace(disk_mb=cfg.disk_mb + VERIFIER_DISK_HEADROOM_MB)
    with staged_copy(task.tests_dir) as tests:
        return run_sandboxed(["bash", "/tests/test.sh"], workspace, cfg, mounts={"/tests": tests})


def run_oracle(task: Task, workspace: Path, cfg: SandboxConfig | None = None) -> SandboxResult:
    """The task's solution/solve.sh in `workspace`; a copy of solution/ is read-only at /solution."""
    cfg = cfg or sandbox_config(task, task.limits.wall_seconds)
    with staged_copy(task.solution_dir) as solution:
        return run_sandboxed(["bash", "/solution/solve.sh"], workspace, cfg, mounts={"/solution": solution})
