"""The request handler of `jaxpi serve` and `jaxpi gateway`: JSON in, JSON or events out.

`JsonHandler` (a `BaseHTTPRequestHandler`) reads the JSON body (`read_json`, its size capped and its
Content-Length checked by `body_length`), answers JSON (with Content-Length, so keep-alive works)
or a server-sent-event stream (closed at its end, no length), checks the bearer key, and turns
every failure into an OpenAI error object. It runs under `jaxpi.serve.httpbase.Server`, which hands
it each request read whole (`BufferedRequest`), or under a stdlib `ThreadingHTTPServer`.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import re
import socket
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from jaxpi.serve.config import HttpLimits
from jaxpi.serve.protocol import ApiError, error_type, sse, status_error

log = logging.getLogger("jaxpi.http")
MAX_BODY = HttpLimits().max_body_bytes  # the default limit (handlers under a stdlib server use it)
_DIGITS = re.compile(rb"[0-9]+")


class RefusedError(Exception):
    """A request refused before it reaches a handler: the status and the message to send."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = error_type(status) if kind is None else kind


def body_length(values: list[bytes] | list[str], max_body: int) -> int:
    """The body length a request's Content-Length header(s) give: digits only; several headers must
    agree; over `max_body` is 413. Anything else (negative, signed, hex, empty, a list) is 400."""
    raw = [v.encode("latin-1") if isinstance(v, str) else v for v in values]
    vals = {v.strip(b" \t") for v in raw}
    if not vals:
        return 0
    if len(vals) > 1:
        raise RefusedError(
            400, f"conflicting Content-Length headers: {sorted(v.decode('latin-1') for v in vals)}"
        )
    (v,) = vals
    if not _DIGITS.fullmatch(v):
        shown = v.decode("latin-1")[:40]
        raise RefusedError(400, f"Content-Length must be a non-negative integer, got {shown!r}")
    # 18 digits are beyond any limit; a longer number is not even parsed.
    n = int(v) if len(v) <= 18 else max_body + 1
    if n > max_body:
        raise RefusedError(413, f"request body of {v.decode()[:40]} bytes is over the {max_body}-byte limit")
    return n


def bearer(headers: Any) -> str | None:
    """The token of `Authorization: Bearer <token>`, or None."""
    auth = headers.get("Authorization") or ""
    scheme, _, token = auth.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def same_key(given: str | None, key: str) -> bool:
    """Constant-time comparison of a client's key with ours."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8"))


def unauthorized(missing: bool) -> ApiError:
    message = (
        "Missing API key: send it as 'Authorization: Bearer <key>'"
        if missing
        else "Incorrect API key provided"
    )
    # OpenAI's code for a bad key (clients test for it); the type follows the status as everywhere.
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class BufferedRequest:
    """A request the selector thread read whole: the socket to answer on and the request's bytes.
    The handler sets `keep_alive` when the connection may carry another request."""

    def __init__(self, sock: socket.socket, data: bytes):
        self.sock, self.data, self.keep_alive = sock, data, False


class _SocketWriter(io.RawIOBase):
    """An unbuffered writable file over a socket (sendall: partial sends do not lose bytes)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._sock.sendall(b)
        return len(memoryview(b))


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "jaxpi"
    max_body = MAX_BODY  # under `Server`, its limit replaces this

    def setup(self) -> None:
        if isinstance(self.request, BufferedRequest):
            self.connection = self.request.sock
            self.rfile = io.BytesIO(self.request.data)
            self.wfile = _SocketWriter(self.request.sock)
            self.max_body = getattr(self.server, "limits", HttpLimits()).max_body_bytes
        else:
            super().setup()

    def handle(self) -> None:
        if isinstance(self.request, BufferedRequest):
            # One request per hand-over; the selector thread reads the next one.
            self.close_connection = True
            self.handle_one_request()
            self.request.keep_alive = not self.close_connection
        else:
            super().handle()

    def finish(self) -> None:
        if not isinstance(self.request, BufferedRequest):
            super().finish()

    def handle_expect_100(self) -> bool:
        if isinstance(self.request, BufferedRequest):
            return True  # the selector thread sent "100 Continue" while it waited for the body
        return super().handle_expect_100()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: per-request lines go to debug
        log.debug("%s %s", self.address_string(), format % args)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":  # no status line, no headers: nothing a client here reads
            self.send_error(400, "HTTP/0.9 requests are not supported")
            return False
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib parser's refusals (bad request line, version, header block, method) as
        OpenAI error objects; an unknown method is 405, an unknown HTTP version 400."""
        code = {HTTPStatus.NOT_IMPLEMENTED: 405, HTTPStatus.HTTP_VERSION_NOT_SUPPORTED: 400}.get(code, code)
        text = message or HTTPStatus(code).phrase
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # the parser's default before it read a version
            self.request_version = "HTTP/1.1"
        with contextlib.suppress(OSError):
            self.send_json(code, status_error(code, text), close=True)

    def read_json(self) -> Any:
        # A size cap: one runaway client must not exhaust the memory the model lives in.
        try:
            n = body_length(self.headers.get_all("Content-Length") or [], self.max_body)
        except RefusedError as e:
            self.close_connection = True
            raise ApiError(e.status, e.message) from None
        try:
            raw = self.rfile.read(n) if n else b""
        except TimeoutError:
            self.close_connection = True
            raise ApiError(408, "the request body did not arrive in time") from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None

    def check_key(self, key: str | None) -> None:
        """401 unless the request carries `Authorization: Bearer <key>` (no-op when key is None)."""
        if key is not None and not same_key(bearer(self.headers), key):
            raise unauthorized(missing=bearer(self.headers) is None)

    def send_json(
        self, status: int, obj: Any, *, headers: Mapping[str, str] | None = None, close: bool = False
    ) -> None:
        self.send_bytes(status, json.dumps(obj).encode(), "application/json", headers=headers, close=close)

    def send_bytes(
        self,
        status: int,
        data: bytes,
        content_type: str,
        *,
        headers: Mapping[str, str] | None = None,
        close: bool = False,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, e: ApiError) -> None:
        # A refusal of the body's framing leaves the rest of the connection unreadable: close it.
        self.send_json(e.status, e.body(), headers=e.headers, close=self.close_connection)

    def send_events(self, events: Iterable[dict | str]) -> None:
        """An SSE stream: each event as `data: ...` as soon as it is produced, then `data: [DONE]`;
        the connection closes. The iterable is closed however the stream ends (a generator's
        `finally` learns that its client went away)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        # No Content-Length on a stream: closing the connection marks its end (valid HTTP/1.1).
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for ev in events:
                self.wfile.write(sse(ev))
                self.wfile.flush()
            self.wfile.write(sse("[DONE]"))
            self.wfile.flush()
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def guarded(self, fn: Any) -> None:
        """Run one endpoint; any failure becomes an OpenAI error object (500 if unexpected)."""
        try:
            fn()
        except ApiError as e:
            self.send_error_json(e)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            # The client went away or stopped reading its answer.
            self.close_connection = True
        except Exception as e:
            log.exception("internal error")
            self.send_json(500, status_error(500, f"internal error: {type(e).__name__}: {e}"))

    def not_found(self) -> None:
        self.send_json(404, status_error(404, f"no route {self.command} {self.path}"))
