"""The task audit: a task is sound only if its oracle passes and an untouched workspace fails.

For every task, each step in its own sandbox and its own fresh workspace:
  1. oracle: copy environment/, run solution/solve.sh, then tests/test.sh; both must exit 0;
  2. empty:  copy environment/, run tests/test.sh alone; it must fail (a verifier that passes an
     attempt that did nothing rewards doing nothing).
A task that does not load is reported broken with the loader's message.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxpi.sandbox import SandboxResult
from jaxpi.tasks.run import new_workspace, run_oracle, run_verifier, workspace_root
from jaxpi.tasks.task import Task, TaskError, find_task_dirs, load_task


@dataclasses.dataclass(frozen=True)
class TaskAudit:
    task: str  # the task id, or its directory when it did not load
    path: str
    oracle_passed: bool
    empty_failed: bool
    seconds: float
    reasons: tuple[str, ...]  # why the task is broken; empty when it is sound

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def verdict(self) -> str:
        return "ok" if self.ok else "broken"

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "reasons": list(self.reasons), "verdict": self.verdict}


def _tail(text: str, n: int = 300) -> str:
    text = text.strip()
    return ("..." + text[-n:]) if len(text) > n else text


def _describe(what: str, r: SandboxResult) -> str:
    limit = f", stopped by the {r.killed_reason} limit" if r.killed_reason else ""
    out = _tail(r.stderr) or _tail(r.stdout)
    return f"{what} exited {r.returncode}{limit}" + (f": {out}" if out else "")


def audit_task(task: Task, root: Path) -> TaskAudit:
    """Audit one loaded task, with workspaces under `root` (see `workspace_root`)."""
    start = time.monotonic()
    reasons = []
    # A separate workspace per step: the untouched run must not see what the oracle wrote.
    ws = new_workspace(task, root)
    solved = run_oracle(task, ws)
    oracle_passed = False
    if not solved.ok:
        reasons.append(_describe("oracle solution/solve.sh", solved))
    else:
        checked = run_verifier(task, ws)
        oracle_passed = checked.ok
        if not checked.ok:
            reasons.append(_describe("verifier after the oracle", checked))
    untouched = run_verifier(task, new_workspace(task, root))
    # Failing by a limit (a verifier that hangs or blows up on an empty workspace) is not the
    # clean "fail" we need: attempts would then be scored by the sandbox, not by the verifier.
    empty_failed = untouched.returncode != 0 and untouched.killed_reason is None
    if untouched.ok:
        reasons.append("verifier passes the untouched workspace")
    elif untouched.killed_reason is not None:
        reasons.append(_describe("verifier on the untouched workspace", untouched))
    return TaskAudit(
        task=task.id,
        path=str(task.path),
        oracle_passed=oracle_passed,
        empty_failed=empty_failed,
        seconds=time.monotonic() - start,
        reasons=tuple(reasons),
    )


def _audit_dir(task_dir: Path, root: Path) -> TaskAudit:
    try:
        task = load_task(task_dir)
    except TaskError as e:
        return TaskAudit(str(task_dir), str(task_dir), False, False, 0.0, (f"does not load: {e}",))
    return audit_task(task, root)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    audits: tuple[TaskAudit, ...]

    @property
    def ok(self) -> bool:
        return bool(self.audits) and all(a.ok for a in self.audits)

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "tasks": len(self.audits),
            "broken": sum(not a.ok for a in self.audits),
            "audits": [a.to_json() for a in self.audits],
        }

    def table(self) -> str:
        rows = [("task", "oracle", "empty", "verdict", "seconds")]
        for a in self.audits:
            mark = {True: "✓", False: "✗"}
            rows.append((a.task, mark[a.oracle_passed], mark[a.empty_failed], a.verdict, f"{a.seconds:.1f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        broken = [a for a in self.audits if not a.ok]
        for a in broken:
            lines += [f"\n{a.task} is broken:"] + [f"  - {r}" for r in a.reasons]
        lines.append(f"\n{len(self.audits) - len(broken)}/{len(self.audits)} tasks pass the audit")
        return "\n".join(lines)


def audit_tasks(root: str | Path, jobs: int = 1, only: tuple[str, ...] = ()) -> AuditReport:
    """Audit every task under `root` (`only`: task directory names or ids to keep), `jobs` at a time."""
    dirs = find_task_dirs(root)
    if only:
        dirs = [d for d in dirs if d.name in only or _id_of(d) in only]
        if not dirs:
            raise TaskError(f"{root}: none of the tasks {list(only)} found")
    if not dirs:
        raise TaskError(f"{root}: no task directories (none holds a task.toml)")
    # Threads suffice: each audit step waits on a sandboxed subprocess.
    with workspace_root("jaxpi-audit-") as ws_root, ThreadPoolExecutor(max(1, jobs)) as pool:
        audits = list(pool.map(lambda d: _audit_dir(d, ws_root), dirs))
    return AuditReport(tuple(audits))


def _id_of(task_dir: Path) -> str | None:
    try:
        return load_task(task_dir).id
    except TaskError:
        return None
