"""Runs inside the sandbox (stdlib only, started by the sandbox's launch line before the command).

    python3 inner_relay.py PORT=SOCKET [PORT=SOCKET ...]

Listens on 127.0.0.1:PORT in the sandbox's own network namespace and carries every connection to
the unix socket SOCKET, which the host side (`jaxpi.sandbox.relay.HostRelay`) carries on to the one
real endpoint. It forks into the background once every port is bound, so the command that follows
finds the endpoint already listening.
"""

import contextlib
import os
import socket
import sys
import threading


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def serve(listener: socket.socket, path: str) -> None:
    while True:
        conn, _ = listener.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(path)
        except OSError:
            conn.close()
            up.close()
            continue
        threading.Thread(target=pump, args=(conn, up), daemon=True).start()
        threading.Thread(target=pump, args=(up, conn), daemon=True).start()


def main(specs: list[str]) -> None:
    listeners = []
    for spec in specs:
        port, path = spec.split("=", 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(port)))
        s.listen(64)
        listeners.append((s, path))
    # Bound: let the launch line go on to the command while we serve in the background.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    threads = [threading.Thread(target=serve, args=ls, daemon=True) for ls in listeners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1:])
