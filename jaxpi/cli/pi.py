"""`jaxpi pi setup [--json]` (install the pinned Pi) and `jaxpi pi run TASK --endpoint URL ...` (one
sandboxed attempt against a running OpenAI-compatible endpoint, usually the gateway)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import uuid
from typing import Any

from jaxpi.cli.config_args import ConfigSpec, Flag, add_command_parser, add_config_arguments, build_config
from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for
from jaxpi.runner.install import DEFAULT_VERSION, release
from jaxpi.runner.pi_config import PiRunConfig


@dataclasses.dataclass(frozen=True)
class SetupConfig:
    """`jaxpi pi setup`: which Pi release, and where it is installed."""

    prefix: str | None = None  # npm prefix; None: $JAXPI_PI_PREFIX, else .tools/pi in the checkout
    # a release jaxpi has checked: 1.6.0 (@earendil-works, the default) or 0.73.1 (@mariozechner)
    version: str = DEFAULT_VERSION
    force: bool = False  # reinstall even if the stamp says it is there

    def __post_init__(self) -> None:
        release(self.version)  # ValueError naming the checked releases


SETUP = ConfigSpec(
    SetupConfig,
    "pi-setup",
    (
        Flag("--prefix", "prefix", "npm prefix (default: .tools/pi)"),
        Flag("--version", "version", "the Pi release: 1.6.0 (default) or 0.73.1"),
        Flag("--force", "force", "reinstall even if the stamp says it is there"),
    ),
)
RUN = ConfigSpec(
    PiRunConfig,
    "pi",
    (
        Flag("task", "task", "a task directory"),
        Flag("--endpoint", "endpoint", "OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1"),
        Flag("--level", "level", "Pi thinking level (off, minimal, low, medium, high, xhigh)"),
        Flag("--model-id", "model_id", "model name sent to the endpoint"),
        Flag("--attempt-id", "attempt_id", "the attempt's id, naming its outputs (default: random)"),
        Flag(
            "--api-key",
            "api_key",
            "the API key Pi sends: a jaxpi gateway's token for the attempt (POST /jaxpi/attempts), or the "
            "server's --api-key (default: the attempt id)",
        ),
        Flag("--out", "out", "output directory (default: runs/pi/<attempt id>)"),
        Flag("--wall-seconds", "wall_seconds", "0 = the task's limit"),
    ),
)


def add_subparser(sub: Any) -> None:
    """Register `jaxpi pi ...` on the top-level subparsers object."""
    pi = sub.add_parser("pi", help=help_for("pi"))
    psub = pi.add_subparsers(dest="pi_command", required=True)
    st = add_command_parser(
        psub,
        "setup",
        help="install Pi (@earendil-works/pi-coding-agent 1.6.0, or --version 0.73.1) and its Node.js into "
        ".tools/pi (idempotent)",
        description="npm install of a checked Pi release and npm's Node.js 24 binary into the project-local "
        "prefix ($JAXPI_PI_PREFIX, else .tools/pi in the checkout), atomically: the prefix holds one release "
        "at a time. A stamp file makes reruns a no-op; --force reinstalls.",
    )
    add_config_arguments(st, SETUP)
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_setup)
    run = add_command_parser(
        psub,
        "run",
        help="one Pi attempt at a task in the sandbox against ENDPOINT, scored by its verifier",
        description="Fresh workspace, isolated Pi config home (models.json -> ENDPOINT, --api-key as its "
        "API key), Pi in the sandbox at --level, then the task's verifier. Writes session.jsonl, "
        "events.jsonl, verifier.txt and record.json into --out.",
    )
    add_config_arguments(run, RUN)
    run.add_argument("--json", action="store_true")
    run.set_defaults(fn=cmd_run)


def cmd_setup(args: argparse.Namespace) -> int:
    from jaxpi.runner.install import pi_setup

    cfg: SetupConfig = build_config(args)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    info = pi_setup(cfg.prefix, version=cfg.version, force=cfg.force, say=say)
    state = "installed" if info["installed"] else "already installed"
    text = f"{info['package']}@{info['version']} {state} in {info['prefix']} (node {info['node_version']})"
    emit(info, args.json, text)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from jaxpi.runner.attempt import RunnerConfig, run_attempt
    from jaxpi.tasks.task import load_task

    cfg: PiRunConfig = build_config(args)
    task = load_task(cfg.task)
    attempt_id = cfg.attempt_id or f"pi-{uuid.uuid4().hex[:12]}"
    out = cfg.out or f"runs/pi/{attempt_id}"
    runner = RunnerConfig(model_id=cfg.model_id, wall_seconds=cfg.wall_seconds, jobs=1)
    key = (lambda _: cfg.api_key) if cfg.api_key else None
    rec = run_attempt(task, cfg.level, cfg.endpoint, attempt_id, out_dir=out, cfg=runner, key=key)
    verdict = ("pass" if rec.success else "fail") if rec.admitted else f"not admitted ({rec.reason})"
    text = (
        f"{task.id} @ {rec.level}: {verdict}; {rec.turns} turns, {rec.output_tokens} output tokens, "
        f"{rec.wall_seconds:.1f} s{'; ' + rec.detail if rec.detail else ''}\nrecord: {out}/record.json"
    )
    emit(rec.to_json(), args.json, text)
    return 0 if rec.admitted else 1
