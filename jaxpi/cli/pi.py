"""`jaxpi pi setup [--json]` (install the pinned Pi) and `jaxpi pi run TASK --endpoint URL ...` (one
sandboxed attempt against a running OpenAI-compatible endpoint, usually the gateway)."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

from jaxpi.cli.registry import help_for


def add_subparser(sub: Any) -> None:
    """Register `jaxpi pi ...` on the top-level subparsers object."""
    pi = sub.add_parser("pi", help=help_for("pi"))
    psub = pi.add_subparsers(dest="pi_command", required=True)
    st = psub.add_parser(
        "setup",
        help="install @mariozechner/pi-coding-agent (pinned) into .tools/pi (idempotent)",
        description="npm install of the pinned Pi into the project-local prefix ($JAXPI_PI_PREFIX, "
        "else .tools/pi in the checkout). A stamp file makes reruns a no-op; --force reinstalls.",
    )
    st.add_argument("--prefix", default=None, help="npm prefix (default: .tools/pi)")
    st.add_argument("--force", action="store_true", help="reinstall even if the stamp says it is there")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_setup)
    run = psub.add_parser(
        "run",
        help="one Pi attempt at a task in the sandbox against ENDPOINT, scored by its verifier",
        description="Fresh workspace, isolated Pi config home (models.json -> ENDPOINT, --api-key as its "
        "API key), Pi in the sandbox at --level, then the task's verifier. Writes session.jsonl, "
        "events.jsonl, verifier.txt and record.json into --out.",
    )
    run.add_argument("task", help="a task directory")
    run.add_argument(
        "--endpoint", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1"
    )
    run.add_argument(
        "--level", default="medium", help="Pi thinking level (off, minimal, low, medium, high, xhigh)"
    )
    run.add_argument("--model-id", default="policy", help="model name sent to the endpoint")
    run.add_argument(
        "--attempt-id", default=None, help="the attempt's id, naming its outputs (default: random)"
    )
    run.add_argument(
        "--api-key",
        default=None,
        help="the API key Pi sends: a jaxpi gateway's token for the attempt (POST /jaxpi/attempts), or the "
        "server's --api-key (default: the attempt id)",
    )
    run.add_argument("--out", default=None, help="output directory (default: runs/pi/<attempt id>)")
    run.add_argument("--wall-seconds", type=float, default=0.0, help="0 = the task's limit")
    run.add_argument("--json", action="store_true")
    run.set_defaults(fn=cmd_run)


def cmd_setup(args: argparse.Namespace) -> int:
    from jaxpi.runner.install import pi_setup

    info = pi_setup(args.prefix, force=args.force, say=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        state = "installed" if info["installed"] else "already installed"
        print(f"Pi {info['version']} {state} in {info['prefix']} (node {info['node']})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from jaxpi.runner.attempt import RunnerConfig, run_attempt
    from jaxpi.tasks.task import load_task

    task = load_task(args.task)
    attempt_id = args.attempt_id or f"pi-{uuid.uuid4().hex[:12]}"
    out = args.out or f"runs/pi/{attempt_id}"
    cfg = RunnerConfig(model_id=args.model_id, wall_seconds=args.wall_seconds, jobs=1)
    key = (lambda _: args.api_key) if args.api_key else None
    rec = run_attempt(task, args.level, args.endpoint, attempt_id, out_dir=out, cfg=cfg, key=key)
    if args.json:
        print(json.dumps(rec.to_json(), indent=2))
    else:
        verdict = ("pass" if rec.success else "fail") if rec.admitted else f"not admitted ({rec.reason})"
        print(
            f"{task.id} @ {rec.level}: {verdict}; {rec.turns} turns, {rec.output_tokens} output tokens, "
            f"{rec.wall_seconds:.1f} s{'; ' + rec.detail if rec.detail else ''}\nrecord: {out}/record.json"
        )
    return 0 if rec.admitted else 1
