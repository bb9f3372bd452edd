"""A TCP relay for tests: a client reaches a server through it, and the test drops its connections."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpRelay:
    """A TCP relay on `host` to 127.0.0.1:`target` (datagrams to `host` do not go through). The first
    `drop_first` connections are closed once the client has sent something, as a peer that fails mid-handshake."""

    def __init__(self, host: str, target: int, drop_first: int = 0) -> None:
        self.target = target
        self.dropped = 0
        self._drop_first = drop_first
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:  # closed
                return
            if self.dropped < self._drop_first:
                self.dropped += 1
                with contextlib.suppress(OSError), down:
                    down.settimeout(10)
                    down.recv(1)
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:  # the coordinator is down: the client connects again
                down.close()
                continue
            up.settimeout(None)
            self._open += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drop_connections(self) -> None:
        for s in self._open:
            s.close()
        self._open.clear()

    def close(self) -> None:
        self._listener.close()
        self.drop_connections()
