"""What `jaxpi serve` and `jaxpi gateway` share: the key and HTTP-limit flags, and serving until
SIGTERM/SIGINT."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from typing import Any

from jaxpi.cli.config_args import Flag
from jaxpi.cli.output import emit
from jaxpi.serve.config import API_KEY_ENV


def http_flags(key_help: str | None = None) -> tuple[Flag, ...]:
    """The key and the HTTP limits, shared by `jaxpi serve` and `jaxpi gateway`."""
    return (
        Flag(
            "--api-key",
            "api_key",
            key_help or f"clients must send 'Authorization: Bearer KEY' (else 401); default ${API_KEY_ENV}",
            convert=or_none,
        ),
        Flag(
            "--read-timeout",
            "read_timeout_s",
            "seconds a client has to send a whole request (then 408 and the connection closes)",
        ),
        Flag("--max-request-mb", "max_request_mb", "largest request body (a larger one is 413)"),
        Flag("--max-connections", "max_connections", "open connections at most (then 503)"),
        Flag(
            "--http-workers",
            "http_workers",
            "threads answering requests (requests still being read hold none)",
        ),
    )


def or_none(value: Any) -> Any:
    """An empty flag (a key of "", a count of 0) is the config's None: the environment's key, the
    derived default."""
    return value or None


def keys_from_env(cfg: Any, env: dict[str, str]) -> Any:
    """`cfg` with each key field (name -> environment variable) that is None taken from the
    environment, as vLLM's VLLM_API_KEY."""
    found = {name: os.environ.get(var) or None for name, var in env.items() if getattr(cfg, name) is None}
    return dataclasses.replace(cfg, **{k: v for k, v in found.items() if v is not None})


def serve_until_signal(handle: Any, info: dict[str, Any], as_json: bool) -> int:
    """Print where the server listens, then block until SIGTERM/SIGINT and close it. With
    `as_json` the one line holds `url`, `pid` and `api_key` when `info` has one."""
    # Handlers only set an event: closing sockets inside a signal frame could deadlock serve_forever.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    extra = "".join(f"\n  {k}: {v}" for k, v in info.items() if k not in ("url", "pid"))
    shown = {k: info[k] for k in ("url", "pid", "api_key") if k in info}
    emit(shown, as_json, f"serving on {info['url']} (pid {info['pid']}){extra}", one_line=True)
    stop.wait()
    handle.close()
    if not as_json:
        print("stopped", file=sys.stderr, flush=True)
    return 0
