"""Standard-library HTTP plumbing shared by `jaxpi serve` and `jaxpi gateway`.

`Server` reads requests on one selector thread and answers complete ones on a bounded pool of
worker threads:

    accept ──► read (selector thread, non-blocking) ──► a whole request ──► worker: handler ──► answer
                 │  head ≤ 64 KiB, body ≤ max_body_bytes (413 before reading it),
                 │  Content-Length digits only (else 400), no Transfer-Encoding (411),
                 │  the request complete within read_timeout_s of its first byte (else 408)
                 └─ over max_connections: 503

so a client that sends half a request, or trickles it, holds a socket and a buffer, never a
thread, and a normal request is answered while hundreds such hang. Keep-alive connections go back
to the selector between requests. Every refusal, from the selector or a handler, is an OpenAI
error object `{"error": {"message", "type", "param", "code"}}` with a 4xx status (503 for a full
server), never a traceback or a dropped connection.

Handlers are `JsonHandler`s (`BaseHTTPRequestHandler`): they read the JSON body (`read_json`),
answer JSON (with Content-Length, so keep-alive works) or a server-sent-event stream (closed at
its end, no length). A `JsonHandler` also runs under a stdlib `ThreadingHTTPServer`.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import io
import json
import logging
import queue
import re
import selectors
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from jaxpi.serve.config import HttpLimits
from jaxpi.serve.protocol import ApiError, error_body, sse

log = logging.getLogger("jaxpi.http")
MAX_BODY = HttpLimits().max_body_bytes  # the default limit (handlers under a stdlib server use it)
MAX_HEAD = 64 * 1024  # request line and headers together
LINGER_S = 2.0  # after refusing a request, how long its client's remaining bytes are read and dropped
_DIGITS = re.compile(rb"[0-9]+")


class RefusedError(Exception):
    """A request refused before it reaches a handler: the status and the message to send."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


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
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    """A whole HTTP/1.1 error response that closes the connection (sent from the selector thread)."""
    body = json.dumps(error_body(message, kind, None, status)).encode()
    phrase = HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nServer: jaxpi\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


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
            self.send_json(code, error_body(text, "invalid_request_error", None, code), close=True)

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
            raise ApiError(408, "the request body did not arrive in time", kind="timeout_error") from None
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
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
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
        """An SSE stream: each event as `data: ...`, then `data: [DONE]`; the connection closes."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        # No Content-Length on a stream: closing the connection marks its end (valid HTTP/1.1).
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for ev in events:
            self.wfile.write(sse(ev))
            self.wfile.flush()
        self.wfile.write(sse("[DONE]"))
        self.wfile.flush()

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
            self.send_json(
                500, error_body(f"internal error: {type(e).__name__}: {e}", "internal_error", None, 500)
            )

    def not_found(self) -> None:
        self.send_json(404, error_body(f"no route {self.command} {self.path}", "NotFoundError", None, 404))


class _Conn:
    """One client connection as the selector thread sees it."""

    __slots__ = ("addr", "buf", "deadline", "drained", "need", "scanned", "sock", "state")

    def __init__(self, sock: socket.socket, addr: Any, deadline: float):
        self.sock, self.addr, self.deadline = sock, addr, deadline
        self.buf = bytearray()
        self.state = "read"  # read | busy (a worker has it) | drain (refused; reading to EOF)
        self.need: int | None = None  # the whole request's length once its head is in
        self.scanned = 0  # how far the head's end has been searched for
        self.drained = 0


def _head_end(buf: bytearray, start: int) -> int:
    """Index just past the blank line ending the head, or -1."""
    ends = [i + n for i, n in ((buf.find(b"\r\n\r\n", start), 4), (buf.find(b"\n\n", start), 2)) if i >= 0]
    return min(ends) if ends else -1


def _framing(head: bytes, max_body: int) -> tuple[int, bool]:
    """(body length, whether the client waits for "100 Continue") from a request head."""
    fields: dict[bytes, list[bytes]] = collections.defaultdict(list)
    lines = head.split(b"\n")
    for line in lines[1:]:
        line = line.rstrip(b"\r")
        if line[:1] in (b" ", b"\t"):  # RFC 9112: reject, or a proxy and we may frame differently
            raise RefusedError(400, "obsolete line folding in the request head")
        name, sep, value = line.partition(b":")
        if sep and name != name.strip(b" \t"):
            raise RefusedError(400, f"whitespace around the header name {name.decode('latin-1').strip()!r}")
        if sep:
            fields[name.lower()].append(value.strip(b" \t"))
    if fields.get(b"transfer-encoding"):
        raise RefusedError(411, "Transfer-Encoding is not supported: send the body with a Content-Length")
    n = body_length(fields.get(b"content-length", []), max_body)
    version = lines[0].rstrip(b"\r").rpartition(b" ")[2]
    expect = version == b"HTTP/1.1" and any(v.lower() == b"100-continue" for v in fields.get(b"expect", []))
    return n, expect


class Server:
    """An HTTP/1.1 server: a selector thread reads requests, `limits.workers` threads answer them.

    The interface `Handle` and the handlers use is `socketserver`'s: `server_address`,
    `serve_forever()`, `shutdown()`, `server_close()`; plus `drop_connections()`, which closes the
    open (keep-alive or in-flight) connections so that a closed server looks to its clients like
    a stopped process.
    """

    def __init__(self, server_address: tuple[str, int], handler: Any, limits: HttpLimits | None = None):
        self.RequestHandlerClass, self.limits = handler, limits or HttpLimits()
        host = server_address[0]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server(server_address, family=family, backlog=1024)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.socket, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: set[_Conn] = set()
        self._returned: collections.deque[tuple[_Conn, bool]] = collections.deque()
        self._jobs: queue.SimpleQueue[tuple[_Conn, bytes] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = self._idle = 0
        self._stop = self._closed = False
        self._running, self._stopped = threading.Event(), threading.Event()
        self._emfile_logged = 0.0

    # ---- the selector thread ----------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._running.set()
        try:
            while not self._stop:
                for key, _ in self._sel.select(self._timeout(poll_interval)):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        self._readable(key.data)
                self._take_returned()
                self._expire()
        finally:
            self._stopped.set()

    def _timeout(self, poll: float) -> float:
        if self._returned:
            return 0.0
        now = time.monotonic()
        soonest = min((c.deadline for c in self._conns if c.state != "busy"), default=now + poll)
        return max(0.0, min(poll, soonest - now))

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: leave the rest in the backlog a moment
                now = time.monotonic()
                if now - self._emfile_logged > 10:
                    log.warning("accept failed: %s", e)
                    self._emfile_logged = now
                time.sleep(0.01)
                return
            sock.setblocking(False)
            # An answer is a head and a body, two sends: without this the body waits for the
            # client's delayed ACK of the head (Nagle), ~40 ms per request on Linux.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, addr, time.monotonic() + self.limits.read_timeout_s)
            open_ = sum(c.state != "drain" for c in self._conns)
            if open_ >= self.limits.max_connections:
                if len(self._conns) - open_ >= self.limits.max_connections:
                    sock.close()  # even the refusals are at their cap
                    continue
                self._conns.add(conn)
                self._refuse(
                    conn,
                    RefusedError(503, f"too many connections ({open_} open); retry later", "server_error"),
                    registered=False,
                )
                continue
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if conn.state == "drain":
            conn.drained += len(data)
            if not data or conn.drained > self.limits.max_body_bytes:
                self._close(conn)
            return
        if not data:  # the client hung up (a request it did not finish is dropped with it)
            self._close(conn)
            return
        if not conn.buf:  # a request's first byte: its read deadline starts now
            conn.deadline = time.monotonic() + self.limits.read_timeout_s
        conn.buf += data
        self._parse(conn)

    def _parse(self, conn: _Conn) -> None:
        if conn.need is None:
            while conn.buf[:1] in (b"\r", b"\n") and conn.buf:  # blank lines between requests
                del conn.buf[:1]
            end = _head_end(conn.buf, max(0, conn.scanned - 3))
            conn.scanned = len(conn.buf)
            if end < 0:
                if len(conn.buf) > MAX_HEAD:
                    status = 414 if b"\n" not in conn.buf else 431
                    self._refuse(conn, RefusedError(status, f"request head over {MAX_HEAD} bytes"))
                return
            if end > MAX_HEAD:
                self._refuse(conn, RefusedError(431, f"request head over {MAX_HEAD} bytes"))
                return
            try:
                n, expect = _framing(bytes(conn.buf[:end]), self.limits.max_body_bytes)
            except RefusedError as e:
                self._refuse(conn, e)
                return
            conn.need = end + n
            if expect and len(conn.buf) < conn.need:
                with contextlib.suppress(OSError):
                    conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        if len(conn.buf) >= conn.need:
            data = bytes(conn.buf[: conn.need])
            del conn.buf[: conn.need]
            conn.need, conn.scanned, conn.state = None, 0, "busy"
            self._sel.unregister(conn.sock)
            self._submit(conn, data)

    def _refuse(self, conn: _Conn, e: RefusedError, *, registered: bool = True) -> None:
        """Answer from this thread and close after a linger: a client still sending (a body over
        the limit) reads the answer instead of a reset."""
        with contextlib.suppress(OSError):
            conn.sock.send(error_response(e.status, e.message, e.kind))
        self._linger(conn, registered)

    def _linger(self, conn: _Conn, registered: bool) -> None:
        conn.state, conn.buf = "drain", bytearray()
        conn.deadline = time.monotonic() + min(LINGER_S, self.limits.read_timeout_s)
        try:
            conn.sock.shutdown(socket.SHUT_WR)
            if registered:
                self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
            else:
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
        except (OSError, KeyError, ValueError):
            self._close(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns if c.state != "busy" and c.deadline <= now]:
            if conn.state == "read" and conn.buf:
                self._refuse(
                    conn,
                    RefusedError(
                        408,
                        f"the request did not arrive within {self.limits.read_timeout_s:g} s",
                        "timeout_error",
                    ),
                )
            else:  # an idle keep-alive connection, or a refused one done lingering
                self._close(conn)

    def _take_returned(self) -> None:
        while self._returned:
            conn, keep = self._returned.popleft()
            if not keep or self._stop:
                self._linger(conn, registered=False)
                continue
            conn.state = "read"
            conn.deadline = time.monotonic() + self.limits.read_timeout_s
            try:
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError):
                self._close(conn)
                continue
            if conn.buf:  # a pipelined request already here
                self._parse(conn)

    def _close(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        self._conns.discard(conn)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe is already a pending wake-up
            self._wake_w.send(b"x")

    # ---- the workers --------------------------------------------------------------------------------
    def _submit(self, conn: _Conn, data: bytes) -> None:
        self._jobs.put((conn, data))
        with self._lock:
            if self._idle < self._jobs.qsize() and self._workers < self.limits.workers:
                self._workers += 1
                threading.Thread(target=self._work, name="jaxpi-http-worker", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
            if job is None:
                return
            conn, data = job
            req = BufferedRequest(conn.sock, data)
            try:
                # Sends time out too: a client that never reads its answer does not keep the worker.
                conn.sock.settimeout(self.limits.read_timeout_s)
                self.RequestHandlerClass(req, conn.addr, self)
            except Exception:
                log.debug("request from %s failed", conn.addr, exc_info=True)
                req.keep_alive = False
            with contextlib.suppress(OSError):
                conn.sock.setblocking(False)
            with self._lock:
                if self._closed:
                    with contextlib.suppress(OSError):
                        conn.sock.close()
                    continue
                self._returned.append((conn, req.keep_alive))
            self._wake()

    # ---- lifecycle ------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the selector loop and wait for it to end (from another thread)."""
        self._stop = True
        self._wake()
        if self._running.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        with self._lock:
            self._closed = True
            workers = self._workers
        for _ in range(workers):
            self._jobs.put(None)
        for conn in list(self._conns):
            if conn.state != "busy":
                self._close(conn)
        for s in (self.socket, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
        with contextlib.suppress(OSError):
            self._sel.close()

    def drop_connections(self) -> None:
        for conn in list(self._conns):
            with contextlib.suppress(OSError):  # already closed by its client
                conn.sock.shutdown(socket.SHUT_RDWR)


class Handle:
    """A running server: `url`, and `close()` (stops accepting, joins the thread)."""

    def __init__(self, httpd: Any, on_close: Any = None):
        self.httpd, self._on_close = httpd, on_close
        host, port = httpd.server_address[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._thread = threading.Thread(target=httpd.serve_forever, name="jaxpi-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if isinstance(self.httpd, Server):
            self.httpd.drop_connections()
        self._thread.join(timeout=10)
        if self._on_close:
            self._on_close()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
