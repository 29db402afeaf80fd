"""A TCP relay for tests that stand between a replica and PostgreSQL: it accepts on an address of its own and
connects each client to the upstream server. Subclasses decide how bytes cross (`serve`) and how the
client's socket behaves (`prepare`)."""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    def __init__(self, upstream: tuple[str, int], listen: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self.listener = socket.create_server((listen, 0))
        self.port: int = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        hang_up(*self.sockets, close=True)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.prepare(client)
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            threading.Thread(target=self.serve, args=(client, server), daemon=True).start()

    def prepare(self, client: socket.socket) -> None:
        """Set options on a client's socket before it is served."""

    def serve(self, client: socket.socket, server: socket.socket) -> None:
        """Both directions as they come; either side ending ends both."""
        threading.Thread(target=pipe, args=(server, client), daemon=True).start()
        pipe(client, server)


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        hang_up(src, dst)


def hang_up(*sockets: socket.socket, close: bool = False) -> None:
    """End both directions of each socket (the peer sees the connection end); `close` also frees them."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        if close:
            sock.close()
