"""Standard-library HTTP plumbing shared by `jaxpi serve` and `jaxpi gateway`.

`ThreadingHTTPServer` gives one thread per connection; handlers read a JSON body, answer JSON
(with Content-Length, so HTTP/1.1 keep-alive works) or a server-sent-event stream (closed at its
end, no length). Errors always leave as OpenAI error objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jaxpi.serve.protocol import ApiError, error_body, sse

log = logging.getLogger("jaxpi.http")
MAX_BODY = 64 * 1024 * 1024


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "jaxpi"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: per-request lines go to debug
        log.debug("%s %s", self.address_string(), format % args)

    def read_json(self) -> Any:
        # A size cap: one runaway client must not exhaust the memory the model lives in.
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ApiError(413, f"request body of {n} bytes is over the {MAX_BODY}-byte limit")
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    def send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, e: ApiError) -> None:
        self.send_json(e.status, e.body())

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
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            log.exception("internal error")
            self.send_json(
                500, error_body(f"internal error: {type(e).__name__}: {e}", "internal_error", None, 500)
            )

    def not_found(self) -> None:
        self.send_json(404, error_body(f"no route {self.command} {self.path}", "NotFoundError", None, 404))


class Server(ThreadingHTTPServer):
    """`ThreadingHTTPServer` that also drops its open (keep-alive) connections when closed, so a
    closed server looks to clients like a stopped process, not one that still answers old sockets."""

    daemon_threads = True

    def __init__(self, *args: Any, **kw: Any):
        self._open: set[Any] = set()
        self._open_lock = threading.Lock()
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        with self._open_lock:
            socks = list(self._open)
        for sock in socks:
            with contextlib.suppress(OSError):  # already closed by its client
                sock.shutdown(socket.SHUT_RDWR)


class Handle:
    """A running server: `url`, and `close()` (stops accepting, joins the thread)."""

    def __init__(self, httpd: ThreadingHTTPServer, on_close: Any = None):
        self.httpd, self._on_close = httpd, on_close
        host, port = httpd.server_address[:2]
        self.url = f"http://{host}:{port}"
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
