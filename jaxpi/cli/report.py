"""`jaxpi report RUN_DIR...`: the comparison table and pictures of GRPO runs (`jaxpi.rl.report`).

jaxpi report RUN_DIR [RUN_DIR ...] [--out DIR] [--split eval|train] [--window N] [--json]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for
from jaxpi.rl.report import build_report
from jaxpi.stats.levels import SPLITS
from jaxpi.stats.table import finite


def add_subparser(sub: Any) -> None:
    """Register `jaxpi report` on the CLI's subparsers."""
    p = sub.add_parser(
        "report",
        help=help_for("report"),
        description="Read GRPO run directories (run.json + attempts.jsonl) and write frontier.png, "
        "ordering.png, pass_rate.png and report.json. Prints a Markdown table: the first run's first step "
        "as 'start', then each run's last step. Intervals are 95%: Wilson for pass rates, a bootstrap "
        "over tasks for reasoning tokens and their ratios.",
    )
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="GRPO run directories; the first is the start"
    )
    p.add_argument("--out", default=None, help="output directory (default: FIRST_RUN_DIR/report)")
    p.add_argument(
        "--split",
        choices=list(SPLITS),
        default="eval",
        help="held-out eval attempts (default; falls back to train when a run has none) or train",
    )
    p.add_argument("--window", type=int, default=1, help="pool this many consecutive steps per point")
    p.add_argument("--json", action="store_true", help="print report.json's content instead of the table")
    p.set_defaults(fn=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = build_report(args.run_dirs, args.out, args.split, args.window)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    written = [*report["images"], str(Path(report["images"][0]).parent / "report.json")]
    text = report["table"] + "\n\n" + "\n".join(f"wrote {p}" for p in written)
    emit(finite(report), args.json, text)
    return 0
