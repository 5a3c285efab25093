"""Runs inside the sandbox (stdlib only, started by the sandbox's launch line before the command).

    python3 inner_relay.py MAX_CONNECTIONS PORT=SOCKET [PORT=SOCKET ...]

Listens on 127.0.0.1:PORT in the sandbox's own network namespace and carries every connection to
the unix socket SOCKET, which the host side (`jaxpi.sandbox.relay.HostRelay`) carries on to the one
real endpoint. It forks into the background once every port is bound, so the command that follows
finds the endpoint already listening.

`Relay` is the one event loop both halves run: a single thread, whatever the number of
connections, at most `max_connections` carried at once (a connection beyond that is accepted and
closed at once: refused, not queued), each direction buffered one read at a time (a slow reader
slows its writer; nothing piles up).
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import sys
from collections.abc import Callable

_CHUNK = 65536


class _Pair:
    """One carried connection: `a` accepted from a listener, `b` the connection it goes on to."""

    def __init__(self, a: socket.socket, b: socket.socket, connecting: bool) -> None:
        self.a, self.b, self.connecting = a, b, connecting
        self.to_b = self.to_a = b""
        self.a_eof = self.b_eof = False

    def interest(self, s: socket.socket) -> int:
        if self.connecting:
            return selectors.EVENT_WRITE if s is self.b else 0
        mine, theirs_buf, eof = (
            (self.to_a, self.to_b, self.a_eof) if s is self.a else (self.to_b, self.to_a, self.b_eof)
        )
        ev = selectors.EVENT_WRITE if mine else 0
        if not eof and not theirs_buf:
            ev |= selectors.EVENT_READ
        return ev

    def done(self) -> bool:
        return self.a_eof and self.b_eof and not self.to_a and not self.to_b


class Relay:
    """Carry connections from `listeners` to `connect()`'s sockets until `stop()`."""

    def __init__(
        self, listeners: list[tuple[socket.socket, Callable[[], socket.socket]]], max_connections: int
    ) -> None:
        self.max_connections = max_connections
        self.sel = selectors.DefaultSelector()
        self.pairs: dict[socket.socket, _Pair] = {}
        self.refused = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        for listener, connect in listeners:
            listener.setblocking(False)
            self.sel.register(listener, selectors.EVENT_READ, connect)

    def stop(self) -> None:
        """Ask the loop to end (from any thread); `serve` then closes every socket it holds."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def serve(self) -> None:
        try:
            while not self._stopping:
                for key, ev in self.sel.select():
                    if key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    elif callable(key.data):
                        self._accept(key.fileobj, key.data)
                    else:
                        self._step(key.data, key.fileobj, ev)
        finally:
            for pair in list(dict.fromkeys(self.pairs.values())):
                self._close(pair)
            for key in list(self.sel.get_map().values()):
                key.fileobj.close()
            self.sel.close()
            self._wake_w.close()

    def _accept(self, listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
        try:
            a, _ = listener.accept()
        except OSError:
            return
        if len(self.pairs) // 2 >= self.max_connections:
            self.refused += 1
            a.close()
            return
        a.setblocking(False)
        try:
            b = connect()
        except OSError:
            a.close()
            return
        pair = _Pair(a, b, connecting=True)
        self.pairs[a] = self.pairs[b] = pair
        self._update(pair)  # until b is connected, only its writability is of interest

    def _step(self, pair: _Pair, s: socket.socket, ev: int) -> None:
        try:
            if pair.connecting:
                err = pair.b.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))
                pair.connecting = False
            else:
                if ev & selectors.EVENT_WRITE:
                    self._flush(pair, s)
                if ev & selectors.EVENT_READ:
                    self._read(pair, s)
        except OSError:
            self._close(pair)
            return
        if pair.done():
            self._close(pair)
        else:
            self._update(pair)

    def _read(self, pair: _Pair, s: socket.socket) -> None:
        data = s.recv(_CHUNK)
        if s is pair.a:
            if data:
                pair.to_b = data
            else:
                pair.a_eof = True
        elif data:
            pair.to_a = data
        else:
            pair.b_eof = True
        other = pair.b if s is pair.a else pair.a
        if data:
            self._flush(pair, other)
        elif not (pair.to_b if s is pair.a else pair.to_a):
            with contextlib.suppress(OSError):
                other.shutdown(socket.SHUT_WR)

    def _flush(self, pair: _Pair, s: socket.socket) -> None:
        buf = pair.to_a if s is pair.a else pair.to_b
        if not buf:
            return
        try:
            n = s.send(buf)
        except BlockingIOError:
            return
        buf = buf[n:]
        if s is pair.a:
            pair.to_a = buf
            if not buf and pair.b_eof:
                s.shutdown(socket.SHUT_WR)
        else:
            pair.to_b = buf
            if not buf and pair.a_eof:
                s.shutdown(socket.SHUT_WR)

    def _update(self, pair: _Pair) -> None:
        for s in (pair.a, pair.b):
            ev = pair.interest(s)
            key = self.sel.get_map().get(s)
            if ev and key is None:
                self.sel.register(s, ev, pair)
            elif ev and key.events != ev:
                self.sel.modify(s, ev, pair)
            elif not ev and key is not None:
                self.sel.unregister(s)

    def _close(self, pair: _Pair) -> None:
        for s in (pair.a, pair.b):
            self.pairs.pop(s, None)
            if s in self.sel.get_map():
                self.sel.unregister(s)
            s.close()


def connect_nonblocking(family: int, address: object) -> socket.socket:
    """A socket whose connect to `address` is under way (or done); other errors are raised (for a
    unix socket, EAGAIN too: its backlog is full, nothing is under way)."""
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setblocking(False)
    err = s.connect_ex(address)
    if err not in (0, errno.EINPROGRESS):
        s.close()
        raise OSError(err, os.strerror(err))
    return s


def main(args: list[str]) -> None:
    max_connections, specs = int(args[0]), args[1:]
    listeners = []
    for spec in specs:
        port, path = spec.split("=", 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(port)))
        s.listen(64)
        listeners.append((s, lambda path=path: connect_nonblocking(socket.AF_UNIX, path)))
    # Bound: let the launch line go on to the command while we serve in the background.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    Relay(listeners, max_connections).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
