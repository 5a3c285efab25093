"""`jaxpi sft --config FILE [key.sub=value ...] [--json]`: LoRA SFT (`jaxpi.sft.loop.run_sft`).

Exit status 3 when a step's loss or gradient norm is not finite (the last good checkpoint kept).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxpi.cli.config_args import CONFIG_DIR
from jaxpi.cli.registry import help_for
from jaxpi.configfile import load_config, resolve_path
from jaxpi.configfile.help import add_config_help
from jaxpi.sft.config import SFTConfig
from jaxpi.sft.loop import NonFiniteError, run_sft

NON_FINITE = 3  # a trainer's own stop (jaxpi.cli.errors: 3 and up)


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi sft` on the CLI's subparsers."""
    p = sub.add_parser(
        "sft",
        help=help_for("sft"),
        description="Train a LoRA adapter on admitted Pi sessions. Rerunning the same command resumes from "
        "the latest checkpoint in output.dir. See docs/sft.md for every config field.",
    )
    p.add_argument(
        "--config", required=True, help="YAML file, e.g. configs/sft/tiny.yaml, or a NAME of configs/sft/"
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override any config field")
    p.add_argument("--json", action="store_true", help="no progress bar; print a JSON summary at the end")
    p.set_defaults(fn=cmd_sft)
    add_config_help(p, SFTConfig)
    return p


def cmd_sft(args: argparse.Namespace) -> int:
    cfg = load_config(SFTConfig, resolve_path(args.config, CONFIG_DIR / "sft"), args.overrides)
    try:
        summary = run_sft(cfg, progress=not args.json, out=sys.stderr if args.json else sys.stdout)
    except NonFiniteError as e:
        print(f"jaxpi sft: {e}", file=sys.stderr)
        return NON_FINITE
    if args.json:
        print(json.dumps(summary, indent=2))
    elif summary["final_loss"] is None:  # resumed at the last step: nothing left to train
        print(f"done already: {summary['steps']} steps, checkpoint {summary['checkpoint']}")
    else:
        print(
            f"done: {summary['steps']} steps, loss {summary['final_loss']:.4f}"
            + (f", val loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else "")
            + f", checkpoint {summary['checkpoint']}"
        )
    return 0
