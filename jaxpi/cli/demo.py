"""`jaxpi demo`: what `make demo` runs."""

from __future__ import annotations

import argparse
from typing import Any

from jaxpi.cli.registry import help_for


def add_subparser(sub: Any) -> None:
    """Register `jaxpi demo`."""
    demo = sub.add_parser(
        "demo",
        help=help_for("demo"),
    )
    demo.add_argument(
        "--out", default=None, help="where to keep checkpoints and the run (default: a temp dir)"
    )
    demo.add_argument("--seq-len", type=int, default=48, help="sequence length of the parity check")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true")
    demo.add_argument(
        "--full", action="store_true", help="run the whole effort-ordered vs binary GRPO comparison (longer)"
    )
    demo.set_defaults(fn=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """Parity, a short LoRA SFT on the demo Pi sessions, export, and the adapter reloaded in peft."""
    from jaxpi.demo import run_demo

    return run_demo(args.out, seed=args.seed, seq_len=args.seq_len, as_json=args.json, full=args.full)
