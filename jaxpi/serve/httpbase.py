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

Handlers are `JsonHandler`s (`jaxpi.serve.handler`), each given one request read whole.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import queue
import selectors
import socket
import threading
import time
from http import HTTPStatus
from typing import Any

from jaxpi.serve.config import HttpLimits
from jaxpi.serve.handler import BufferedRequest, RefusedError, body_length
from jaxpi.serve.protocol import error_body, error_type

log = logging.getLogger("jaxpi.http")
MAX_HEAD = 64 * 1024  # request line and headers together
LINGER_S = 2.0  # after refusing a request, how long its client's remaining bytes are read and dropped


def error_response(status: int, message: str, kind: str | None = None) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection (sent from the selector thread)."""
    body = json.dumps(error_body(message, kind or error_type(status), None, status)).encode()
    phrase = HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nServer: jaxpi\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


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
                    RefusedError(503, f"too many connections ({open_} open); retry later"),
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
