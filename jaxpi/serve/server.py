"""`jaxpi serve`'s HTTP front: routes, the request log and metrics, and `start_server` (the Python API).

    GET  /health               200 once the engine is built (needs no API key, as vLLM's)
    GET  /metrics              Prometheus text (no API key, as vLLM's; `jaxpi.serve.metrics`)
    GET  /v1/models            the one served model
    GET  /jaxpi/stats          batcher counters (requests, engine calls, rows per call)
    POST /v1/chat/completions  chat: one JSON reply, or a stream sent as the tokens are sampled
    POST /v1/completions       token-id (or text) prompts, vLLM's rollout surface

With an API key set, every route but /health and /metrics needs `Authorization: Bearer <key>`
(401 without it). Every request is one INFO line on the `jaxpi.serve` logger:

    POST /v1/chat/completions status=200 model=ckpt prompt_tokens=57 completion_tokens=12 latency_s=0.231 stream=true
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from jaxpi.serve.batcher import Batcher
from jaxpi.serve.chat import ChatFormat
from jaxpi.serve.config import HttpLimits, ServeConfig
from jaxpi.serve.handler import JsonHandler
from jaxpi.serve.httpbase import Handle, Server
from jaxpi.serve.metrics import CONTENT_TYPE, Metrics
from jaxpi.serve.service import RequestInfo, Service

log = logging.getLogger("jaxpi.serve")


class ServeHandler(JsonHandler):
    def __init__(self, *args: Any, service: Service, metrics: Metrics, api_key: str | None = None, **kw: Any):
        self.service, self.metrics, self.api_key = service, metrics, api_key
        self.status: int | None = None
        self.info = RequestInfo()
        super().__init__(*args, **kw)

    def send_response(self, code: int, message: str | None = None) -> None:
        self.status = code
        super().send_response(code, message)

    def _logged(self, route: Any) -> None:
        """Run one request's route, then its log line and metrics (also when the client left)."""
        self.status, self.info = None, RequestInfo()
        t0 = time.perf_counter()
        self.metrics.running.inc()
        try:
            route()
        finally:
            self.metrics.running.dec()
            dt = time.perf_counter() - t0
            path, info = self.path.split("?")[0], self.info
            status = self.status or 499  # no answer: the client went away first (nginx's 499)
            self.metrics.observe(self.command, path, status, dt, info.prompt_tokens, info.completion_tokens)
            log.info(
                "%s %s status=%d model=%s prompt_tokens=%d completion_tokens=%d latency_s=%.3f stream=%s",
                self.command,
                path[:200],
                status,
                info.model or "-",
                info.prompt_tokens,
                info.completion_tokens,
                dt,
                str(info.stream).lower(),
            )

    def _keyed(self, fn: Any) -> Any:
        def run() -> None:
            self.check_key(self.api_key)
            fn()

        return run

    def do_GET(self) -> None:
        self._logged(self._get)

    def do_POST(self) -> None:
        self._logged(self._post)

    def _get(self) -> None:
        path = self.path.split("?")[0]
        if path == "/health":
            self.guarded(lambda: self.send_json(200, {"status": "ok"}))
        elif path == "/metrics":
            self.guarded(lambda: self.send_bytes(200, self.metrics.text(), CONTENT_TYPE))
        elif path == "/v1/models":
            self.guarded(self._keyed(lambda: self.send_json(200, self.service.models())))
        elif path == "/jaxpi/stats":
            self.guarded(self._keyed(lambda: self.send_json(200, self.service.batcher.stats.as_dict())))
        else:
            self.not_found()

    def _post(self) -> None:
        path = self.path.split("?")[0]
        if path == "/v1/chat/completions":
            self.guarded(self._keyed(self._chat))
        elif path == "/v1/completions":
            self.guarded(
                self._keyed(
                    lambda: self.send_json(200, self.service.completions(self.read_json(), self.info))
                )
            )
        else:
            self.not_found()

    def _chat(self) -> None:
        # Every refusal comes before the first byte; a stream then goes out as it is sampled.
        prep = self.service.prepare_chat(self.read_json(), self.info)
        if prep.req.stream:
            self.send_events(self.service.stream_chat(prep, self.info))
        else:
            self.send_json(200, self.service.run_chat(prep, self.info))


class ServeHandle(Handle):
    """Adds the service (stats, format) to the generic handle."""

    def __init__(self, httpd: Server, service: Service, metrics: Metrics, info: dict[str, Any]):
        self.service, self.metrics, self.info = service, metrics, info
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
    stream_interval: int = 1,
) -> ServeHandle:
    """Serve an engine that already exists (e.g. the GRPO trainer's, whose weights change).

    `api_key`: clients must send `Authorization: Bearer <api_key>` (None: no key). `limits`:
    read timeout, body size, connections and worker threads (default `HttpLimits()`).
    `stream_interval`: tokens per engine call while a stream is in the batch.

    To swap weights while serving, hold `handle.service.batcher.engine_lock` around
    `engine.update_weights(...)`: batches run under the same lock.
    """
    from jaxpi.data.render import RenderConfig, load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    fmt = ChatFormat(tok, RenderConfig(tokenizer_dir=str(tokenizer_dir)))
    max_len = max_len or engine.max_len
    # One worker thread owns the engine; HTTP threads only parse, render, wait and answer.
    batcher = Batcher(
        engine,
        max_rows=engine.batch_size,
        wait_s=batch_wait_ms / 1000,
        seed=seed,
        stream_interval=stream_interval,
    )
    service = Service(
        fmt,
        batcher,
        served=served,
        max_len=max_len,
        max_new_tokens=min(max_new_tokens, max_len - 1),
        vocab_size=engine.vocab_size,
    )
    metrics = Metrics(waiting=batcher.waiting)
    handler = partial(ServeHandler, service=service, metrics=metrics, api_key=api_key)
    httpd = Server((host, port), handler, limits)
    return ServeHandle(httpd, service, metrics, {"model": served, **(info or {})})


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
        stream_interval=cfg.stream_interval,
    )
