"""`jaxpi data check PATHS... [--tokenizer DIR] [--json]`: read, gate and render, then report.

Prints the gate report (sessions, admitted, counts per reason, file:line of every exclusion) and
token statistics (examples, tokens, supervised tokens, reasoning tokens; in all and per effort).
Malformed records never stop the check: each is reported at its `file:line` and the check goes
on with the next line and the next file. Exit status 0 when at least one example was produced,
1 when none was, 2 for a bad invocation (an unknown option, a path that does not exist) or, with
--strict, at the first unreadable record.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from jaxpi.cli.registry import help_for

_DEFAULT_TOKENIZER = "the bundled tiny tokenizer"


def _bytes(text: str) -> int:
    """A positive byte count: 4194304, 4MiB, 4MB (binary units either way), 512K."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"not a positive size in bytes: {text!r} (e.g. 4MiB, 65536)")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]


def add_subparser(sub: Any) -> None:
    """Register `jaxpi data ...` on the top-level subparsers object."""
    data = sub.add_parser("data", help=help_for("data"))
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
    chk.add_argument(
        "--max-line-bytes",
        type=_bytes,
        default=None,
        help="longest line read; longer ones are rejected unread (default 4MiB)",
    )
    chk.add_argument(
        "--max-session-bytes",
        type=_bytes,
        default=None,
        help="largest Pi session file read (default 64MiB)",
    )
    chk.add_argument("--strict", action="store_true", help="stop at the first unreadable record")
    chk.add_argument("--json", action="store_true", help="print one JSON object")
    chk.set_defaults(fn=cmd_data_check)


def cmd_data_check(args: argparse.Namespace) -> int:
    from jaxpi.data import TINY_TOKENIZER, GateConfig, RenderConfig, build_examples, token_stats
    from jaxpi.data.sessions import ReadLimits

    gate = GateConfig(
        require_verified=not args.allow_unverified,
        allowed_efforts=tuple(args.efforts.split(",")) if args.efforts else None,
        min_assistant_turns=args.min_turns,
        max_assistant_turns=args.max_turns,
        max_tokens=args.max_tokens,
    )
    render = RenderConfig(tokenizer_dir=args.tokenizer or TINY_TOKENIZER)
    sizes = {"max_line_bytes": args.max_line_bytes, "max_session_bytes": args.max_session_bytes}
    limits = ReadLimits(**{k: v for k, v in sizes.items() if v is not None})
    examples, report = build_examples(args.paths, render, gate, strict=args.strict, limits=limits)
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
