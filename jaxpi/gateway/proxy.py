"""`jaxpi gateway`'s HTTP front: an OpenAI-compatible proxy that records every call per attempt.

    GET  /health                     the gateway's own health (and its upstream URL)
    GET  /v1/models                  upstream's, passed through
    POST /v1/chat/completions        forwarded (see `upstream`), recorded, answered
    GET  /jaxpi/attempts             {attempt: number of calls}
    GET  /jaxpi/attempts/<id>        that attempt's records, in call order

The attempt is the `X-Jaxpi-Attempt` header, else the API key (`Authorization: Bearer <id>`),
else "anonymous". Every call is recorded, failed ones too (with `error`), so a collector can
refuse an attempt whose calls did not all succeed and say why.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

from jaxpi.gateway.records import RecordStore, valid_attempt
from jaxpi.gateway.upstream import UpstreamError, check_reply, client_view, post, upstream_body
from jaxpi.serve.httpbase import Handle, JsonHandler, Server
from jaxpi.serve.protocol import ApiError, error_body, stream_chunks


class Gateway:
    """The proxy's state: upstream base URL, an httpx client (thread-safe), the record store."""

    def __init__(self, upstream: str, store: RecordStore, timeout_s: float = 600.0):
        import httpx

        self.upstream = upstream.rstrip("/")
        if self.upstream.endswith("/v1"):
            self.upstream = self.upstream[: -len("/v1")]
        self.store, self.timeout_s = store, timeout_s
        self.client = httpx.Client(timeout=timeout_s)
        self.counts = {"calls": 0, "errors": 0}
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    def chat(self, attempt: str, body: Any) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """(status, client body or error body, record) for one chat call."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if (body.get("n") or 1) != 1:
            raise ApiError(400, "the gateway records one choice per call: 'n' must be 1", param="n")
        t0, start = time.perf_counter(), time.time()
        record: dict[str, Any] = {
            "time": start,
            "latency_s": None,
            "stream": bool(body.get("stream")),
            "request": body,
            "reasoning_effort": body.get("reasoning_effort"),
            "prompt_token_ids": None,
            "completion_token_ids": None,
            "logprobs": None,
            "finish_reason": None,
            "message": None,
            "usage": None,
            "status": 200,
            "error": None,
        }
        try:
            # Non-streaming upstream: one reply holds prompt ids, completion ids and logprobs.
            reply = post(
                self.client, f"{self.upstream}/v1/chat/completions", upstream_body(body), self.timeout_s
            )
            record.update(check_reply(reply))
            status, out = 200, client_view(reply, body)
        except UpstreamError as e:
            record.update(status=e.status, error=e.record())
            status, out = e.status, e.body or error_body(e.message, e.kind, None, e.status)
        record["latency_s"] = round(time.perf_counter() - t0, 6)
        with self._lock:
            self.counts["calls"] += 1
            self.counts["errors"] += record["error"] is not None
        # Recorded before the client is answered: a client that hangs up still leaves its call on disk.
        return status, out, self.store.append(attempt, record)


def attempt_of(headers: Any) -> str:
    attempt = headers.get("X-Jaxpi-Attempt")
    if not attempt:
        auth = headers.get("Authorization") or ""
        attempt = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    attempt = attempt or "anonymous"
    if not valid_attempt(attempt):
        raise ApiError(
            400,
            "attempt id (API key or X-Jaxpi-Attempt) must be 1-128 of [A-Za-z0-9._:@+=-], not starting with a symbol",
        )
    return attempt


class GatewayHandler(JsonHandler):
    def __init__(self, *args: Any, gateway: Gateway, **kw: Any):
        self.gw = gateway
        super().__init__(*args, **kw)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/health":
            self.guarded(
                lambda: self.send_json(200, {"status": "ok", "upstream": self.gw.upstream, **self.gw.counts})
            )
        elif path == "/v1/models":
            self.guarded(self._models)
        elif path == "/jaxpi/attempts":
            self.guarded(lambda: self.send_json(200, {"attempts": self.gw.store.attempts()}))
        elif path.startswith("/jaxpi/attempts/"):
            self.guarded(lambda: self._attempt(path[len("/jaxpi/attempts/") :]))
        else:
            self.not_found()

    def do_POST(self) -> None:
        if self.path.split("?")[0] == "/v1/chat/completions":
            self.guarded(self._chat)
        else:
            self.not_found()

    def _models(self) -> None:
        import httpx

        try:
            r = self.gw.client.get(f"{self.gw.upstream}/v1/models", timeout=30)
            self.send_json(r.status_code, r.json())
        except (httpx.HTTPError, ValueError) as e:
            raise ApiError(
                502, f"upstream {self.gw.upstream} unreachable: {e}", kind="upstream_unreachable"
            ) from None

    def _attempt(self, attempt: str) -> None:
        records = self.gw.store.get(attempt) if valid_attempt(attempt) else None
        if records is None:
            raise ApiError(404, f"no calls recorded for attempt {attempt!r}", kind="NotFoundError")
        self.send_json(200, {"attempt": attempt, "calls": records})

    def _chat(self) -> None:
        attempt = attempt_of(self.headers)
        body = self.read_json()
        status, out, _ = self.gw.chat(attempt, body)
        if status == 200 and body.get("stream"):
            opts = body.get("stream_options") or {}
            self.send_events(stream_chunks(out, include_usage=bool(opts.get("include_usage"))))
        else:
            self.send_json(status, out)


def start_gateway(
    upstream: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    record_dir: str | None = None,
    timeout_s: float = 600.0,
) -> Handle:
    """Serve the gateway on a thread; returns a handle with `.url`, `.gateway` and `.close()`."""
    gw = Gateway(upstream, RecordStore(record_dir), timeout_s)
    httpd = Server((host, port), partial(GatewayHandler, gateway=gw))
    handle = Handle(httpd, on_close=gw.close)
    handle.gateway = gw  # type: ignore[attr-defined]
    return handle
