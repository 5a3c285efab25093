"""`jaxpi gateway`: the recording OpenAI-compatible proxy, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
from typing import Any

from jaxpi.cli.config_args import ConfigSpec, Flag, add_command_parser, add_config_arguments, build_config
from jaxpi.cli.registry import help_for
from jaxpi.cli.serving import http_flags, keys_from_env, or_none, serve_until_signal
from jaxpi.serve.config import API_KEY_ENV, UPSTREAM_API_KEY_ENV, GatewayConfig

SPEC = ConfigSpec(
    GatewayConfig,
    "gateway",
    (
        Flag("--upstream", "upstream", "base URL of vLLM or jaxpi serve, e.g. http://127.0.0.1:8000"),
        Flag("--host", "host"),
        Flag("--port", "port", "0 picks a free port"),
        Flag(
            "--record-dir",
            "record_dir",
            "where <attempt>.jsonl files go (default: a temp dir, removed at exit)",
        ),
        Flag("--timeout", "timeout_s", "seconds to wait for upstream (then 504)"),
        Flag(
            "--upstream-api-key",
            "upstream_api_key",
            "sent upstream as 'Authorization: Bearer KEY' (upstream's --api-key); default $JAXPI_UPSTREAM_API_KEY",
            convert=or_none,
        ),
        *http_flags(
            key_help="the gateway's key: opens attempts, reads records, may name a call's attempt "
            "(X-Jaxpi-Attempt); default $JAXPI_API_KEY, else a random one, printed"
        ),
    ),
)


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi gateway`."""
    p = add_command_parser(
        sub,
        "gateway",
        help=help_for("gateway"),
        description="Forward /v1/chat/completions (streaming or not) upstream with return_token_ids and logprobs, "
        "answer the client normally, and record every call per attempt in --record-dir/<attempt>.jsonl. "
        "Attempts are opened with the gateway's key (POST /jaxpi/attempts -> a token per attempt, the "
        "client's API key); records are read at GET /jaxpi/attempts/<id>. See docs/serve.md.",
    )
    add_config_arguments(p, SPEC)
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"url": ..., "pid": ...} (and a generated "api_key") once serving',
    )
    p.set_defaults(fn=cmd_gateway)
    return p


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The `GatewayConfig` of parsed `jaxpi gateway` arguments; the keys fall back to
    $JAXPI_API_KEY and $JAXPI_UPSTREAM_API_KEY."""
    cfg = build_config(args, SPEC)
    return keys_from_env(cfg, {"api_key": API_KEY_ENV, "upstream_api_key": UPSTREAM_API_KEY_ENV})


def cmd_gateway(args: argparse.Namespace) -> int:
    from jaxpi.gateway.proxy import start_gateway

    cfg = gateway_config(args)  # a bad value is a ValueError: `jaxpi gateway: error: ...`, exit 2
    handle = start_gateway(cfg)
    info = {"url": handle.url, "pid": os.getpid(), "upstream": cfg.upstream, "record_dir": cfg.record_dir}
    if cfg.api_key is None:  # generated: the operator learns it here or not at all
        info["api_key"] = handle.api_key
    return serve_until_signal(handle, info, args.json)
