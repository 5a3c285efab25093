"""The host half of the policy-endpoint path: unix socket in the sandbox -> one TCP host:port.

The sandbox has no network (its own network namespace, loopback only), so a command inside cannot
reach any address, including the host's loopback. For each allowed endpoint the host listens on a
unix socket in a private directory bound into the sandbox, and `inner_relay.py` inside listens on
127.0.0.1:port and forwards there. The path is fixed per endpoint: nothing inside can choose the
destination, so exactly the configured host:port is reachable and nothing else. No daemon: the
host half is one thread of the process that runs the sandbox, alive for that run only, carrying
at most `max_connections` connections at once (the rest are refused); `close()` ends the thread
and every connection it carried, upstream ones included.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from jaxpi.sandbox.inner_relay import Relay, connect_nonblocking

INNER_RELAY = Path(__file__).with_name("inner_relay.py")


class HostRelay:
    """Serve `endpoints` on unix sockets `<directory>/ep-<port>.sock` until `close()`."""

    def __init__(
        self, endpoints: tuple[tuple[str, int], ...], directory: Path, max_connections: int = 64
    ) -> None:
        self.sockets: dict[int, Path] = {}
        listeners = []
        for host, port in endpoints:
            path = directory / f"ep-{port}.sock"
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(path))
            path.chmod(0o777)  # the sandbox user differs from ours
            s.listen(64)
            self.sockets[port] = path
            listeners.append((s, lambda t=(host, port): _connect_tcp(t)))
        self._relay = Relay(listeners, max_connections)
        self._thread = threading.Thread(target=self._relay.serve, name="jaxpi-relay", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections refused at the cap so far."""
        return self._relay.refused

    def inner_args(self, mount_dir: str) -> list[str]:
        """`PORT=SOCKET` arguments for inner_relay.py, with sockets seen under `mount_dir` inside."""
        return [f"{port}={mount_dir}/{path.name}" for port, path in self.sockets.items()]

    def close(self) -> None:
        self._relay.stop()
        self._thread.join()


def _connect_tcp(target: tuple[str, int]) -> socket.socket:
    # One upstream connection per sandbox connection: the endpoint sees ordinary clients. A numeric
    # address connects without blocking; a name is resolved first (the endpoints are the caller's).
    host, port = target
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return connect_nonblocking(info[0], info[4])
