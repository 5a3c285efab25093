"""`jaxpi serve`'s HTTP front: routes, the streaming form, and `start_server` (the Python API).

    GET  /health               200 once the engine is built (needs no API key, as vLLM's)
    GET  /v1/models            the one served model
    GET  /jaxpi/stats          batcher counters (requests, engine calls, rows per call)
    POST /v1/chat/completions  chat (stream or not)
    POST /v1/completions       token-id (or text) prompts, vLLM's rollout surface

Streaming sends the finished turn as a sequence of chunks (role, reasoning, content, each tool
call, finish), since the engine decodes a whole batch in one compiled loop without returning to
the host per token. With an API key set, every other route needs `Authorization: Bearer <key>`
(401 without it).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from jaxpi.serve.batcher import Batcher
from jaxpi.serve.chat import ChatFormat
from jaxpi.serve.config import HttpLimits, ServeConfig
from jaxpi.serve.handler import JsonHandler
from jaxpi.serve.httpbase import Handle, Server
from jaxpi.serve.protocol import stream_chunks
from jaxpi.serve.service import Service


class ServeHandler(JsonHandler):
    def __init__(self, *args: Any, service: Service, api_key: str | None = None, **kw: Any):
        self.service, self.api_key = service, api_key
        super().__init__(*args, **kw)

    def _keyed(self, fn: Any) -> Any:
        def run() -> None:
            self.check_key(self.api_key)
            fn()

        return run

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/health":
            self.guarded(lambda: self.send_json(200, {"status": "ok"}))
        elif path == "/v1/models":
            self.guarded(self._keyed(lambda: self.send_json(200, self.service.models())))
        elif path == "/jaxpi/stats":
            self.guarded(self._keyed(lambda: self.send_json(200, self.service.batcher.stats.as_dict())))
        else:
            self.not_found()

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        if path == "/v1/chat/completions":
            self.guarded(self._keyed(self._chat))
        elif path == "/v1/completions":
            self.guarded(self._keyed(lambda: self.send_json(200, self.service.completions(self.read_json()))))
        else:
            self.not_found()

    def _chat(self) -> None:
        # The turn is complete before the first byte goes out: streaming only changes the framing.
        reply = self.service.chat(self.read_json())
        if reply.stream:
            self.send_events(stream_chunks(reply.response, include_usage=reply.include_usage))
        else:
            self.send_json(200, reply.response)


class ServeHandle(Handle):
    """Adds the service (stats, format) to the generic handle."""

    def __init__(self, httpd: Server, service: Service, info: dict[str, Any]):
        self.service, self.info = service, info
        super().__init__(httpd, on_close=service.batcher.close)


def serve_engine(
    engine: Any,
    tokenizer_dir: str | Any,
    *,
    served: str = "policy",
    max_len: int | None = None,
    max_new_tokens: int = 1024,
    host: str = "127.0.0.1",
    port: int = 0,
    batch_wait_ms: float = 5.0,
    seed: int = 0,
    info: dict[str, Any] | None = None,
    api_key: str | None = None,
    limits: HttpLimits | None = None,
) -> ServeHandle:
    """Serve an engine that already exists (e.g. the GRPO trainer's, whose weights change).

    `api_key`: clients must send `Authorization: Bearer <api_key>` (None: no key). `limits`:
    read timeout, body size, connections and worker threads (default `HttpLimits()`).

    To swap weights while serving, hold `handle.service.batcher.engine_lock` around
    `engine.update_weights(...)`: batches run under the same lock.
    """
    from jaxpi.data.render import RenderConfig, load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    fmt = ChatFormat(tok, RenderConfig(tokenizer_dir=str(tokenizer_dir)))
    max_len = max_len or engine.max_len
    # One worker thread owns the engine; HTTP threads only parse, render, wait and answer.
    batcher = Batcher(engine, max_rows=engine.batch_size, wait_s=batch_wait_ms / 1000, seed=seed)
    service = Service(
        fmt,
        batcher,
        served=served,
        max_len=max_len,
        max_new_tokens=min(max_new_tokens, max_len - 1),
        vocab_size=engine.vocab_size,
    )
    httpd = Server((host, port), partial(ServeHandler, service=service, api_key=api_key), limits)
    return ServeHandle(httpd, service, {"model": served, **(info or {})})


def start_server(cfg: ServeConfig, *, loaded: Any = None) -> ServeHandle:
    """Load the model (unless `loaded` is given), build the engine, and serve on a thread.

    Returns once the socket listens; `handle.url` is the base URL (port 0 picks a free port).
    """
    from jaxpi.rollout.jax_engine import JaxEngine
    from jaxpi.serve.loading import load_served_model

    t0 = time.perf_counter()
    loaded = loaded or load_served_model(cfg)
    engine = JaxEngine(
        loaded.model, max_len=cfg.max_len, batch_size=cfg.max_batch, prefill_chunks=cfg.prefill_chunks
    )
    info = {
        "base": str(loaded.base_dir),
        "adapters": list(loaded.adapters),
        "tokenizer": str(loaded.tokenizer_dir),
        "load_s": round(time.perf_counter() - t0, 3),
    }
    return serve_engine(
        engine,
        loaded.tokenizer_dir,
        served=cfg.name,
        max_len=cfg.max_len,
        max_new_tokens=cfg.max_new_tokens,
        host=cfg.host,
        port=cfg.port,
        batch_wait_ms=cfg.batch_wait_ms,
        seed=cfg.seed,
        info=info,
        api_key=cfg.api_key,
        limits=cfg.limits,
    )
