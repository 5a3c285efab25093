"""`jaxpi gateway`: the recording OpenAI-compatible proxy, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "gateway",
        help="OpenAI-compatible proxy in front of vLLM or jaxpi serve that records token ids and logprobs per attempt",
        description="Forward /v1/chat/completions (streaming or not) upstream with return_token_ids and logprobs, "
        "answer the client normally, and record every call per attempt (API key or X-Jaxpi-Attempt) in "
        "--record-dir/<attempt>.jsonl and at GET /jaxpi/attempts/<id>. See docs/serve.md.",
    )
    p.add_argument(
        "--upstream", required=True, help="base URL of vLLM or jaxpi serve, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--record-dir", default=None, help="where <attempt>.jsonl files go (default: memory only)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for upstream (then 504)")
    p.add_argument("--json", action="store_true", help='print {"url": ..., "pid": ...} once serving')
    p.set_defaults(fn=cmd_gateway)
    return p


def cmd_gateway(args: argparse.Namespace) -> int:
    from jaxpi.gateway.proxy import start_gateway
    from jaxpi.serve.cli import serve_until_signal

    handle = start_gateway(
        args.upstream, host=args.host, port=args.port, record_dir=args.record_dir, timeout_s=args.timeout
    )
    info = {"url": handle.url, "pid": os.getpid(), "upstream": args.upstream, "record_dir": args.record_dir}
    return serve_until_signal(handle, info, args.json)
