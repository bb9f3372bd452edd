"""A gossip peer's sockets to its neighbours: dialled at the first send, the least recently used idle one closed past a cap."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import zmq

__all__ = ["MAX_IDLE_SOCKETS", "NeighbourSockets"]

# A peer of an exponential graph of n sends to log2(n) neighbours: dialling every member on
# joining made n sockets (and handshake monitors) a peer, n^2 connections in the pool, and ZMQ
# handshakes timed out at 64 peers in one process.
MAX_IDLE_SOCKETS = 64


class NeighbourSockets:
    """Member id -> (endpoint, DEALER), least recently used first; used by the peer's I/O thread only.

    `dial(pid, endpoint)` opens a socket (None: it cannot be dialled, and said why); `close`
    closes one. Past `cap` sockets, the least recently used one not in `busy()` (a hold awaits
    its reply, or a redial is due) is closed before a new one opens; when every one is busy the
    table goes over the cap rather than lose a reply.
    """

    def __init__(self, dial: Callable[[str, str], zmq.Socket | None], close: Callable[[zmq.Socket], None],
                 cap: int = MAX_IDLE_SOCKETS) -> None:
        self._dial, self._close, self.cap = dial, close, cap
        self._members: dict[str, str] = {}
        self._open: OrderedDict[str, tuple[str, zmq.Socket]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, pid: object) -> bool:
        return pid in self._open

    def get(self, pid: str) -> zmq.Socket | None:
        """The open socket to `pid`, if any (not dialled, not counted as a use)."""
        entry = self._open.get(pid)
        return entry[1] if entry is not None else None

    def for_send(self, pid: str, busy: Callable[[], set[str]]) -> zmq.Socket | None:
        """The socket to member `pid`, dialled now if it has none (None: not a member, or undiallable)."""
        entry = self._open.get(pid)
        if entry is not None:
            self._open.move_to_end(pid)
            return entry[1]
        endpoint = self._members.get(pid)
        if endpoint is None:
            return None
        if len(self._open) >= self.cap:
            held = busy()
            idle = next((p for p in self._open if p not in held), None)
            if idle is not None:
                self._close(self._open.pop(idle)[1])
        return self._open_one(pid, endpoint)

    def redial(self, pid: str) -> None:
        """Replace the socket to `pid` by a new one (libzmq gave up on it)."""
        entry = self._open.pop(pid, None)
        if entry is not None:
            self._close(entry[1])
            self._open_one(pid, entry[0])

    def set_members(self, peers: dict[str, str]) -> list[str]:
        """Adopt the membership; the ids whose socket was closed (gone, or at a new endpoint)."""
        gone = [pid for pid, (endpoint, _) in self._open.items() if peers.get(pid) != endpoint]
        for pid in gone:
            self._close(self._open.pop(pid)[1])
        self._members = dict(peers)
        return gone

    def _open_one(self, pid: str, endpoint: str) -> zmq.Socket | None:
        sock = self._dial(pid, endpoint)
        if sock is not None:
            self._open[pid] = (endpoint, sock)
        return sock
