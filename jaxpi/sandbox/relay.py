"""The host half of the policy-endpoint path: unix socket in the sandbox -> one TCP host:port.

The sandbox has no network (its own network namespace, loopback only), so a command inside cannot
reach any address, including the host's loopback. For each allowed endpoint the host listens on a
unix socket in a private directory bound into the sandbox, and `inner_relay.py` inside listens on
127.0.0.1:port and forwards there. The path is fixed per endpoint: nothing inside can choose the
destination, so exactly the configured host:port is reachable and nothing else. No daemon: the
host half is a few threads of the process that runs the sandbox, alive for that run only.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

INNER_RELAY = Path(__file__).with_name("inner_relay.py")


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class HostRelay:
    """Serve `endpoints` on unix sockets `<directory>/ep-<port>.sock` until `close()`."""

    def __init__(self, endpoints: tuple[tuple[str, int], ...], directory: Path) -> None:
        self.sockets: dict[int, Path] = {}
        self._listeners: list[socket.socket] = []
        self._closed = threading.Event()
        for host, port in endpoints:
            path = directory / f"ep-{port}.sock"
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(path))
            path.chmod(0o777)  # the sandbox user may differ from ours
            s.listen(64)
            s.settimeout(0.2)
            self.sockets[port] = path
            self._listeners.append(s)
            threading.Thread(target=self._serve, args=(s, (host, port)), daemon=True).start()

    def _serve(self, listener: socket.socket, target: tuple[str, int]) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            # Accepted sockets inherit the listener's timeout; the pumps block instead.
            conn.settimeout(None)
            # One upstream connection per sandbox connection: the endpoint sees ordinary clients.
            try:
                up = socket.create_connection(target, timeout=10)
                up.settimeout(None)
            except OSError:
                conn.close()
                continue
            threading.Thread(target=_pump, args=(conn, up), daemon=True).start()
            threading.Thread(target=_pump, args=(up, conn), daemon=True).start()

    def inner_args(self, mount_dir: str) -> list[str]:
        """`PORT=SOCKET` arguments for inner_relay.py, with sockets seen under `mount_dir` inside."""
        return [f"{port}={mount_dir}/{path.name}" for port, path in self.sockets.items()]

    def close(self) -> None:
        self._closed.set()
        for s in self._listeners:
            s.close()
