"""`jaxpi serve`: the OpenAI-compatible server on the embedded JAX engine, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxpi.cli.registry import help_for
from jaxpi.cli.serving import add_http_flags, http_fields, serve_until_signal
from jaxpi.serve.config import API_KEY_ENV, ServeConfig


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi serve`."""
    p = sub.add_parser(
        "serve",
        help=help_for("serve"),
        description="Serve a checkpoint over /v1/chat/completions (streaming or not), /v1/completions "
        "(token-id prompts, logprobs, token ids: vLLM's rollout surface), /v1/models and /health. "
        "Concurrent requests are batched into one engine call. See docs/serve.md.",
    )
    p.add_argument("--model", required=True, help="HF checkpoint dir, or a jaxpi SFT/GRPO run/checkpoint dir")
    p.add_argument(
        "--adapter", default=None, help="jaxpi (orbax) checkpoint or PEFT adapter dir on top of --model"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir when the checkpoint has none")
    p.add_argument("--served-name", default=None, help="model id clients use (default: the dir's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--max-batch", type=int, default=8, help="engine rows decoded together")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long a batch gathers requests")
    p.add_argument(
        "--max-len", type=int, default=4096, help="context limit per request (prompt + completion)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="default max_tokens of chat requests (1024, below --max-len)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0, help="seeds the draws for requests without a seed")
    add_http_flags(p)
    p.add_argument("--json", action="store_true", help='print {"url": ..., "pid": ...} once serving')
    p.set_defaults(fn=cmd_serve)
    return p


def serve_config(args: argparse.Namespace) -> Any:
    """The `ServeConfig` of parsed `jaxpi serve` arguments."""
    return ServeConfig(
        model=args.model,
        adapter=args.adapter,
        tokenizer=args.tokenizer,
        served_name=args.served_name,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        batch_wait_ms=args.batch_wait_ms,
        max_len=args.max_len,
        max_new_tokens=args.max_new_tokens or min(1024, args.max_len - 1),
        dtype=args.dtype,
        seed=args.seed,
        **http_fields(args, API_KEY_ENV),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxpi.serve.server import start_server

    cfg = serve_config(args)  # a bad value is a ValueError: `jaxpi serve: error: ...`, exit 2
    if not args.json:
        print(f"loading {cfg.model} ...", file=sys.stderr, flush=True)
    handle = start_server(cfg)
    return serve_until_signal(handle, {"url": handle.url, "pid": os.getpid(), **handle.info}, args.json)
