"""`jaxpi gateway`'s HTTP front: an OpenAI-compatible proxy that records every call per attempt.

    GET  /health                      the gateway's own health (and its upstream URL); no key
    GET  /v1/models                   upstream's, passed through            (any key below)
    POST /v1/chat/completions         forwarded (see `upstream`), recorded, answered
    POST /jaxpi/attempts              {"attempt": id?} -> 201 {"attempt", "token"}   (gateway key)
    GET  /jaxpi/attempts              {attempt: number of calls}                     (gateway key)
    GET  /jaxpi/attempts/<id>         that attempt's records, in call order          (gateway key)
    POST /jaxpi/attempts/<id>/close   the attempt's token stops working              (gateway key)

Attempt identities are the gateway's to give. Whoever holds the gateway's key (the trainer, the
evaluation) opens an attempt and hands its token to the client (Pi's API key); a call with
`Authorization: Bearer <token>` is recorded under that attempt, and nothing a client sends can
name another one. Tokens are random, kept only as hashes, and never written to the records. The
gateway's key may also name a call's attempt itself (`X-Jaxpi-Attempt`), and it alone lists and
reads records. Every call is recorded, failed ones too (with `error`), so a collector can refuse
an attempt whose calls did not all succeed and say why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import threading
import time
from functools import partial
from typing import Any

from jaxpi.gateway.records import RecordStore, valid_attempt
from jaxpi.gateway.upstream import UpstreamError, check_reply, client_view, post, upstream_body
from jaxpi.serve.config import GatewayConfig
from jaxpi.serve.handler import JsonHandler, bearer, same_key, unauthorized
from jaxpi.serve.httpbase import Handle, Server
from jaxpi.serve.protocol import ApiError, error_body, stream_chunks

ATTEMPT_RULE = "1-128 of [A-Za-z0-9._:@+=-], not starting with a symbol, no '..'"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


class Gateway:
    """The proxy's state: upstream base URL, an httpx client (thread-safe), the record store, and
    the attempts' tokens (hashed)."""

    def __init__(self, cfg: GatewayConfig):
        import httpx

        self.cfg = cfg
        self.upstream = cfg.upstream.rstrip("/")
        if self.upstream.endswith("/v1"):
            self.upstream = self.upstream[: -len("/v1")]
        self.store, self.timeout_s = RecordStore(cfg.record_dir), cfg.timeout_s
        self.api_key = cfg.api_key or secrets.token_urlsafe(32)
        # The clients' keys stay here: upstream gets the gateway's own, or none.
        auth = {"Authorization": f"Bearer {cfg.upstream_api_key}"} if cfg.upstream_api_key else {}
        self.client = httpx.Client(timeout=cfg.timeout_s, headers=auth)
        self.counts = {"calls": 0, "errors": 0}
        self._lock = threading.Lock()
        self._attempt_of: dict[str, str] = {}  # sha256(token) -> attempt
        self._token_of: dict[str, str] = {}  # attempt -> sha256(token), while open
        self._opened: set[str] = set()  # every attempt this gateway gave out: ids are not reused

    def close(self) -> None:
        self.client.close()
        self.store.close()

    def open_attempt(self, attempt: str | None = None) -> tuple[str, str]:
        """A new attempt and its token: (attempt id, token). `attempt` None picks an id. An id that
        was given out before or has records on file is refused (ValueError): one id, one owner."""
        with self._lock:
            if attempt is None:
                attempt = f"att-{secrets.token_hex(8)}"
                while attempt in self._opened or self.store.exists(attempt):
                    attempt = f"att-{secrets.token_hex(8)}"
            elif not valid_attempt(attempt):
                raise ValueError(f"attempt id must be {ATTEMPT_RULE}, got {str(attempt)[:140]!r}")
            elif attempt in self._opened or self.store.exists(attempt):
                raise AttemptExistsError(f"attempt {attempt!r} exists already")
            token = "jxa-" + secrets.token_urlsafe(32)
            self._attempt_of[_digest(token)] = attempt
            self._token_of[attempt] = _digest(token)
            self._opened.add(attempt)
            return attempt, token

    def close_attempt(self, attempt: str) -> bool:
        """Revoke the attempt's token (its records stay); False if it had none open."""
        with self._lock:
            digest = self._token_of.pop(attempt, None)
            if digest is not None:
                self._attempt_of.pop(digest, None)
            return digest is not None

    def attempt_of(self, token: str) -> str | None:
        return self._attempt_of.get(_digest(token))

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


class AttemptExistsError(ValueError):
    """`open_attempt` of an id that is taken."""


def _forbidden(message: str) -> ApiError:
    return ApiError(403, message, kind="permission_error", code="forbidden")


class GatewayHandler(JsonHandler):
    def __init__(self, *args: Any, gateway: Gateway, **kw: Any):
        self.gw = gateway
        super().__init__(*args, **kw)

    def _caller(self) -> str | None:
        """None for the gateway's key, else the attempt whose token the request carries; 401 otherwise."""
        token = bearer(self.headers)
        if same_key(token, self.gw.api_key):
            return None
        attempt = self.gw.attempt_of(token) if token else None
        if attempt is None:
            raise unauthorized(missing=token is None)
        return attempt

    def _admin(self) -> None:
        if self._caller() is not None:
            raise _forbidden("an attempt's token may only call /v1/chat/completions and /v1/models")

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/health":
            self.guarded(
                lambda: self.send_json(200, {"status": "ok", "upstream": self.gw.upstream, **self.gw.counts})
            )
        elif path == "/v1/models":
            self.guarded(self._models)
        elif path == "/jaxpi/attempts":
            self.guarded(self._list)
        elif path.startswith("/jaxpi/attempts/"):
            self.guarded(lambda: self._attempt(path[len("/jaxpi/attempts/") :]))
        else:
            self.not_found()

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        if path == "/v1/chat/completions":
            self.guarded(self._chat)
        elif path == "/jaxpi/attempts":
            self.guarded(self._open)
        elif path.startswith("/jaxpi/attempts/") and path.endswith("/close"):
            self.guarded(lambda: self._close(path[len("/jaxpi/attempts/") : -len("/close")]))
        else:
            self.not_found()

    def _models(self) -> None:
        import httpx

        self._caller()
        try:
            r = self.gw.client.get(f"{self.gw.upstream}/v1/models", timeout=30)
            self.send_json(r.status_code, r.json())
        except (httpx.HTTPError, ValueError) as e:
            raise ApiError(
                502, f"upstream {self.gw.upstream} unreachable: {e}", kind="upstream_unreachable"
            ) from None

    def _list(self) -> None:
        self._admin()
        self.send_json(200, {"attempts": self.gw.store.attempts()})

    def _attempt(self, attempt: str) -> None:
        self._admin()
        records = self.gw.store.get(attempt) if valid_attempt(attempt) else None
        if records is None:
            raise ApiError(404, f"no calls recorded for attempt {attempt[:140]!r}", kind="NotFoundError")
        self.send_json(200, {"attempt": attempt, "calls": records})

    def _open(self) -> None:
        self._admin()
        body = self.read_json() if self.headers.get("Content-Length") not in (None, "0") else {}
        if not isinstance(body, dict):
            raise ApiError(400, 'the request body must be a JSON object, e.g. {"attempt": "task-1.low.0"}')
        try:
            attempt, token = self.gw.open_attempt(body.get("attempt"))
        except AttemptExistsError as e:
            raise ApiError(409, str(e), param="attempt", code="attempt_exists") from None
        except ValueError as e:
            raise ApiError(400, str(e), param="attempt") from None
        self.send_json(201, {"attempt": attempt, "token": token})

    def _close(self, attempt: str) -> None:
        self._admin()
        if not self.gw.close_attempt(attempt):
            raise ApiError(404, f"no open attempt {attempt[:140]!r}", kind="NotFoundError")
        self.send_json(200, {"attempt": attempt, "closed": True})

    def _chat(self) -> None:
        attempt = self._caller()
        named = self.headers.get("X-Jaxpi-Attempt")
        if attempt is None:  # the gateway's own key: the caller names the attempt
            if not named or not valid_attempt(named):
                raise ApiError(
                    400, f"with the gateway's key, name the attempt in X-Jaxpi-Attempt ({ATTEMPT_RULE})"
                )
            attempt = named
        elif named and named != attempt:
            raise _forbidden("X-Jaxpi-Attempt names another attempt than the token's")
        body = self.read_json()
        status, out, _ = self.gw.chat(attempt, body)
        if status == 200 and body.get("stream"):
            opts = body.get("stream_options") or {}
            self.send_events(stream_chunks(out, include_usage=bool(opts.get("include_usage"))))
        else:
            self.send_json(status, out)


def start_gateway(upstream: str | GatewayConfig, **fields: Any) -> Handle:
    """Serve the gateway on a thread; returns a handle with `.url`, `.gateway`, `.api_key` (the
    gateway's key, generated when the config has none) and `.close()`.

    `upstream` is a URL (then `fields` are the other `GatewayConfig` fields: `record_dir`,
    `timeout_s`, `api_key`, `upstream_api_key`, the HTTP limits ...) or a whole `GatewayConfig`.
    """
    cfg = (
        GatewayConfig(upstream=upstream, **{"port": 0, **fields})
        if isinstance(upstream, str)
        else dataclasses.replace(upstream, **fields)
    )
    gw = Gateway(cfg)
    try:
        httpd = Server((cfg.host, cfg.port), partial(GatewayHandler, gateway=gw), cfg.limits)
    except BaseException:
        gw.close()
        raise
    handle = Handle(httpd, on_close=gw.close)
    handle.gateway = gw  # type: ignore[attr-defined]
    handle.api_key = gw.api_key  # type: ignore[attr-defined]
    return handle
