"""A free port held for a node's local process group until its ranks have formed it (no torch import)."""

from __future__ import annotations

import socket

__all__ = ["reserve_port"]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port of `host`, to keep open until the process group has formed.

    A port found free and then closed can be taken by anyone before rank 0's store listens on
    it; the other ranks then reach a stranger ("Ping failed"). Held bound, the kernel hands the
    port to nobody else, while the store's own socket (SO_REUSEADDR, as c10d sets) binds it.
    The port: `sock.getsockname()[1]`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock
