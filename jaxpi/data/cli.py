"""`jaxpi data check PATHS... [--tokenizer DIR] [--json]`: read, gate and render, then report.

Prints the gate report (sessions, admitted, counts per reason, file:line of every exclusion) and
token statistics (examples, tokens, supervised tokens, reasoning tokens; in all and per effort).
Exit status 0 when at least one example was produced, 1 when none was.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

_DEFAULT_TOKENIZER = "the bundled tiny tokenizer"


def add_subparser(sub: Any) -> None:
    """Register `jaxpi data ...` on the top-level subparsers object."""
    data = sub.add_parser("data", help="SFT data: check sessions (read, gate, render, count tokens)")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    chk = data_sub.add_parser(
        "check",
        help="read Pi/OpenAI session files, apply the admission gates, render, report",
        description="Read Pi v3 session files and OpenAI-style JSONL (files or directories, recursive "
        "*.jsonl), apply the admission gates, render the admitted sessions with the tokenizer's chat "
        "template, and print the gate report and token statistics.",
    )
    chk.add_argument("paths", nargs="+", help="session files or directories")
    chk.add_argument(
        "--tokenizer", default=None, help=f"tokenizer dir with a chat template ({_DEFAULT_TOKENIZER})"
    )
    chk.add_argument(
        "--allow-unverified", action="store_true", help="admit sessions the verifier did not pass"
    )
    chk.add_argument("--efforts", default=None, help="comma-separated admitted effort levels (default: any)")
    chk.add_argument("--min-turns", type=int, default=1, help="minimum assistant turns")
    chk.add_argument("--max-turns", type=int, default=None, help="maximum assistant turns")
    chk.add_argument("--max-tokens", type=int, default=None, help="longest rendered example allowed")
    chk.add_argument("--strict", action="store_true", help="stop at the first unreadable record")
    chk.add_argument("--json", action="store_true", help="print one JSON object")
    chk.set_defaults(fn=cmd_data_check)


def cmd_data_check(args: argparse.Namespace) -> int:
    from jaxpi.data import TINY_TOKENIZER, GateConfig, RenderConfig, build_examples, token_stats

    gate = GateConfig(
        require_verified=not args.allow_unverified,
        allowed_efforts=tuple(args.efforts.split(",")) if args.efforts else None,
        min_assistant_turns=args.min_turns,
        max_assistant_turns=args.max_turns,
        max_tokens=args.max_tokens,
    )
    render = RenderConfig(tokenizer_dir=args.tokenizer or TINY_TOKENIZER)
    examples, report = build_examples(args.paths, render, gate, strict=args.strict)
    stats = token_stats(examples)
    longest = max((e.num_tokens for e in examples), default=0)
    if args.json:
        print(json.dumps({"gates": report.to_dict(), "tokens": stats, "longest_example": longest}, indent=2))
    else:
        print(report.table())
        print(f"\n{'':<16}{'examples':>10}{'tokens':>10}{'supervised':>12}{'reasoning':>11}")
        for key, s in stats.items():
            print(
                f"{key:<16}{s['examples']:>10}{s['tokens']:>10}{s['supervised_tokens']:>12}"
                f"{s['reasoning_tokens']:>11}"
            )
        print(f"longest example: {longest} tokens")
    return 0 if examples else 1
