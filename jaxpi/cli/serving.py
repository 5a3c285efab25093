"""What `jaxpi serve` and `jaxpi gateway` share: the key and HTTP-limit flags, and serving until
SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from jaxpi.serve.config import API_KEY_ENV, HttpLimits


def add_http_flags(p: argparse.ArgumentParser, key_help: str | None = None) -> None:
    """The key and the HTTP limits, shared by `jaxpi serve` and `jaxpi gateway`."""
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
