"""`jaxpi serve`: the OpenAI-compatible server on the embedded JAX engine, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from jaxpi.cli.config_args import ConfigSpec, Flag, add_command_parser, add_config_arguments, build_config
from jaxpi.cli.registry import help_for
from jaxpi.cli.serving import http_flags, keys_from_env, or_none, serve_until_signal
from jaxpi.serve.config import API_KEY_ENV, ServeConfig

SPEC = ConfigSpec(
    ServeConfig,
    "serve",
    (
        Flag("--model", "model", "HF checkpoint dir, or a jaxpi SFT/GRPO run/checkpoint dir"),
        Flag("--adapter", "adapter", "jaxpi (orbax) checkpoint or PEFT adapter dir on top of --model"),
        Flag("--tokenizer", "tokenizer", "tokenizer dir when the checkpoint has none"),
        Flag("--served-name", "served_name", "model id clients use (default: the dir's name)"),
        Flag("--host", "host"),
        Flag("--port", "port", "0 picks a free port"),
        Flag("--max-batch", "max_batch", "engine rows decoded together"),
        Flag("--batch-wait-ms", "batch_wait_ms", "how long a batch gathers requests"),
        Flag("--max-len", "max_len", "context limit per request (prompt + completion)"),
        Flag(
            "--max-new-tokens",
            "max_new_tokens",
            "max_tokens of chat requests that send none (1024, below --max-len)",
            convert=or_none,
        ),
        Flag(
            "--stream-interval", "stream_interval", "tokens per engine call while streaming (1: each token)"
        ),
        Flag("--dtype", "dtype", choices=["float32", "bfloat16"]),
        Flag("--seed", "seed", "seeds the draws for requests without a seed"),
        *http_flags(),
    ),
)


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi serve`."""
    p = add_command_parser(
        sub,
        "serve",
        help=help_for("serve"),
        description="Serve a checkpoint over /v1/chat/completions (streamed token by token, or not), "
        "/v1/completions (token-id prompts, logprobs, token ids: vLLM's rollout surface), /v1/models, "
        "/health and /metrics (Prometheus). Concurrent requests are batched into one engine call; "
        "each request is one log line. See docs/serve.md.",
    )
    add_config_arguments(p, SPEC)
    p.add_argument("--json", action="store_true", help='print {"url": ..., "pid": ...} once serving')
    p.set_defaults(fn=cmd_serve)
    return p


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` of parsed `jaxpi serve` arguments; the key falls back to $JAXPI_API_KEY."""
    return keys_from_env(build_config(args, SPEC), {"api_key": API_KEY_ENV})


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxpi.serve.server import start_server

    cfg = serve_config(args)  # a bad value is a ValueError: `jaxpi serve: error: ...`, exit 2
    # One line per request on stderr (the `jaxpi.serve` logger), unless logging is set up already.
    access = logging.getLogger("jaxpi.serve")
    if not access.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
    if not args.json:
        print(f"loading {cfg.model} ...", file=sys.stderr, flush=True)
    handle = start_server(cfg)
    return serve_until_signal(handle, {"url": handle.url, "pid": os.getpid(), **handle.info}, args.json)
