"""`jaxpi gateway`: the recording OpenAI-compatible proxy, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
from typing import Any

from jaxpi.cli.registry import help_for
from jaxpi.cli.serving import add_http_flags, http_fields, serve_until_signal
from jaxpi.serve.config import API_KEY_ENV, UPSTREAM_API_KEY_ENV, GatewayConfig


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi gateway`."""
    p = sub.add_parser(
        "gateway",
        help=help_for("gateway"),
        description="Forward /v1/chat/completions (streaming or not) upstream with return_token_ids and logprobs, "
        "answer the client normally, and record every call per attempt in --record-dir/<attempt>.jsonl. "
        "Attempts are opened with the gateway's key (POST /jaxpi/attempts -> a token per attempt, the "
        "client's API key); records are read at GET /jaxpi/attempts/<id>. See docs/serve.md.",
    )
    p.add_argument(
        "--upstream", required=True, help="base URL of vLLM or jaxpi serve, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument(
        "--record-dir",
        default=None,
        help="where <attempt>.jsonl files go (default: a temp dir, removed at exit)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for upstream (then 504)")
    p.add_argument(
        "--upstream-api-key",
        default=None,
        help="sent upstream as 'Authorization: Bearer KEY' (upstream's --api-key); default $JAXPI_UPSTREAM_API_KEY",
    )
    add_http_flags(
        p,
        key_help="the gateway's key: opens attempts, reads records, may name a call's attempt "
        "(X-Jaxpi-Attempt); default $JAXPI_API_KEY, else a random one, printed",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"url": ..., "pid": ...} (and a generated "api_key") once serving',
    )
    p.set_defaults(fn=cmd_gateway)
    return p


def gateway_config(args: argparse.Namespace) -> Any:
    """The `GatewayConfig` of parsed `jaxpi gateway` arguments."""
    return GatewayConfig(
        upstream=args.upstream,
        host=args.host,
        port=args.port,
        record_dir=args.record_dir,
        timeout_s=args.timeout,
        upstream_api_key=args.upstream_api_key or os.environ.get(UPSTREAM_API_KEY_ENV) or None,
        **http_fields(args, API_KEY_ENV),
    )


def cmd_gateway(args: argparse.Namespace) -> int:
    from jaxpi.gateway.proxy import start_gateway

    cfg = gateway_config(args)  # a bad value is a ValueError: `jaxpi gateway: error: ...`, exit 2
    handle = start_gateway(cfg)
    info = {"url": handle.url, "pid": os.getpid(), "upstream": cfg.upstream, "record_dir": cfg.record_dir}
    if cfg.api_key is None:  # generated: the operator learns it here or not at all
        info["api_key"] = handle.api_key
    return serve_until_signal(handle, info, args.json)
