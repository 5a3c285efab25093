"""`jaxpi serve`: the OpenAI-compatible server on the embedded JAX engine, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server (chat with tools and reasoning, token-id completions) on the JAX engine",
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


def add_http_flags(p: argparse.ArgumentParser, key_help: str | None = None) -> None:
    """The key and the HTTP limits, shared by `jaxpi serve` and `jaxpi gateway`."""
    from jaxpi.serve.config import API_KEY_ENV, HttpLimits

    d = HttpLimits()
    p.add_argument(
        "--api-key",
        default=None,
        help=key_help or f"clients must send 'Authorization: Bearer KEY' (else 401); default ${API_KEY_ENV}",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=d.read_timeout_s,
        help="seconds a client has to send a whole request (then 408 and the connection closes)",
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=d.max_body_bytes / 2**20,
        help="largest request body (a larger one is 413)",
    )
    p.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="open connections at most (then 503)"
    )
    p.add_argument(
        "--http-workers",
        type=int,
        default=d.workers,
        help="threads answering requests (requests still being read hold none)",
    )


def http_fields(args: argparse.Namespace, env_key: str) -> dict[str, Any]:
    """The config fields of `add_http_flags`; the key falls back to the environment variable."""
    return {
        "api_key": args.api_key or os.environ.get(env_key) or None,
        "read_timeout_s": args.read_timeout,
        "max_request_mb": args.max_request_mb,
        "max_connections": args.max_connections,
        "http_workers": args.http_workers,
    }


def serve_config(args: argparse.Namespace) -> Any:
    """The `ServeConfig` of parsed `jaxpi serve` arguments."""
    from jaxpi.serve.config import API_KEY_ENV, ServeConfig

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

    try:
        cfg = serve_config(args)
    except ValueError as e:
        raise SystemExit(f"jaxpi serve: {e}") from None
    if not args.json:
        print(f"loading {cfg.model} ...", file=sys.stderr, flush=True)
    handle = start_server(cfg)
    return serve_until_signal(handle, {"url": handle.url, "pid": os.getpid(), **handle.info}, args.json)


def serve_until_signal(handle: Any, info: dict[str, Any], as_json: bool) -> int:
    """Print where the server listens, then block until SIGTERM/SIGINT and close it. With
    `as_json` the one line holds `url`, `pid` and `api_key` when `info` has one."""
    # Handlers only set an event: closing sockets inside a signal frame could deadlock serve_forever.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if as_json:
        print(json.dumps({k: info[k] for k in ("url", "pid", "api_key") if k in info}), flush=True)
    else:
        extra = "".join(f"  {k}: {v}\n" for k, v in info.items() if k not in ("url", "pid"))
        print(f"serving on {info['url']} (pid {info['pid']})\n{extra}", end="", flush=True)
    stop.wait()
    handle.close()
    if not as_json:
        print("stopped", file=sys.stderr, flush=True)
    return 0
