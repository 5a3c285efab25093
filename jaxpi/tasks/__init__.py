"""Agent tasks: the task directory format, its loader, running oracle/verifier, and the audit."""

from jaxpi.tasks.audit import AuditReport, TaskAudit, audit_task, audit_tasks
from jaxpi.tasks.run import new_workspace, run_oracle, run_verifier, sandbox_config, workspace_root
from jaxpi.tasks.task import Task, TaskError, TaskLimits, find_task_dirs, load_task, load_tasks

__all__ = [
    "AuditReport",
    "Task",
    "TaskAudit",
    "TaskError",
    "TaskLimits",
    "audit_task",
    "audit_tasks",
    "find_task_dirs",
    "load_task",
    "load_tasks",
    "new_workspace",
    "run_oracle",
    "run_verifier",
    "sandbox_config",
    "workspace_root",
]
