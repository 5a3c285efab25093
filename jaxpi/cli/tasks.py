"""`jaxpi tasks list DIR [--json]` and `jaxpi tasks audit DIR [--json] [--jobs N] [--only ID ...]`.

`audit` exits 0 when every task passes (oracle passes, untouched workspace fails), 1 when any is
broken; `list` exits 2 (the CLI's error status) when a task does not load.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from jaxpi.cli.registry import help_for


def add_subparser(sub: Any) -> None:
    """Register `jaxpi tasks ...` on the top-level subparsers object."""
    tasks = sub.add_parser("tasks", help=help_for("tasks"))
    tsub = tasks.add_subparsers(dest="tasks_command", required=True)
    ls = tsub.add_parser("list", help="load and list the tasks under DIR")
    ls.add_argument("dir", help="a task directory or a directory of them (searched recursively)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)
    au = tsub.add_parser(
        "audit",
        help="run each task's oracle and verifier in the sandbox; report broken tasks",
        description="For each task under DIR, in the sandbox: (1) a fresh workspace, solution/solve.sh, then "
        "tests/test.sh must pass; (2) a fresh untouched workspace must fail tests/test.sh. Prints a table "
        "(or --json); exit status 1 when any task is broken.",
    )
    au.add_argument("dir", help="a task directory or a directory of them (searched recursively)")
    au.add_argument("--jobs", type=int, default=1, help="tasks audited at once")
    au.add_argument("--only", nargs="+", default=(), help="task ids or directory names to audit")
    au.add_argument("--json", action="store_true")
    au.set_defaults(fn=cmd_audit)


def cmd_list(args: argparse.Namespace) -> int:
    # Imported here: `jaxpi --help` should not pay for the task and sandbox modules.
    from jaxpi.tasks.task import load_tasks

    tasks = load_tasks(args.dir)
    if args.json:
        print(json.dumps([t.summary() for t in tasks], indent=2))
        return 0
    rows = [("id", "category", "difficulty", "tags")]
    rows += [(t.id, t.category, t.difficulty, ",".join(t.tags)) for t in tasks]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"{len(tasks)} tasks")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from jaxpi.tasks.audit import audit_tasks

    report = audit_tasks(args.dir, jobs=args.jobs, only=tuple(args.only))
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0 if report.ok else 1
