"""The coordinator's UDP heartbeat port: authenticated beats (transport/beat_wire.py) renew leases as the gRPC Heartbeat does, for a fraction of its CPU.

A unary gRPC Heartbeat costs the coordinator about 420 us of CPU, 90 % of it inside grpcio's
asyncio server (docs/scale.md): one core holds about 2,000 nodes at 1 Hz. A beat here is one
datagram in and one out, checked with one HMAC. gRPC stays authoritative: it hands out the keys,
and a node falls back to it whenever beats go unanswered (node/beat_sender.py).

Anyone may send anything here, any number of times. Nothing is allocated per sender: a beat is
parsed in place and looked up in the node table; unknown ids, replays (a counter not above the
last accepted), bad MACs and malformed datagrams are dropped and counted (`dropped`), never
answered, so the port reflects nothing at a forged source. MAC checks are budgeted per node id
(`CHECKS_PER_INTERVAL`), so a flood under a real node's id costs at most that many HMACs an
interval; the node's own beats may then go unanswered and it heartbeats over gRPC meanwhile.
Only a leading coordinator renews: a standby (or a deposed leader) drops every beat.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Protocol, cast

from gossamer.coordinator.beat_rate import renew
from gossamer.coordinator.records import BeatKey
from gossamer.transport import beat_wire
from gossamer.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from gossamer.coordinator.core import Coordinator

log = logging.getLogger(__name__)

#: Why a datagram was dropped unanswered (the label of gossamer_udp_beats_dropped_total).
DROP_REASONS = ("standby", "malformed", "unknown", "replay", "budget", "mac", "error")
#: MAC checks one node id may cost per heartbeat interval (it sends one beat an interval).
CHECKS_PER_INTERVAL = 4
#: Receive buffer asked of the kernel (it caps it at net.core.rmem_max): a burst of beats
#: waits there while the event loop serves something else.
RECV_BUFFER = 4 << 20


class Leading(Protocol):
    """What the port asks of its server: whether it leads, and the state it acts on."""

    @property
    def leading(self) -> bool: ...

    @property
    def coord(self) -> Coordinator | None: ...


class UdpBeats(asyncio.DatagramProtocol):
    """The beat port of one coordinator process (leader or standby); `port` 0 until started."""

    def __init__(self, server: Leading, *, interval_s: float) -> None:
        self._server = server
        self._window_s = interval_s
        self._transport: asyncio.DatagramTransport | None = None
        self.port = 0
        self.served = 0  # beats answered (lease renewed, or "unknown" to a node no longer alive)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    async def start(self, host: str, port: int) -> int:
        """Bind `host`:`port` (0: a free port); the bound port. OSError when it cannot bind."""
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=(host, port))
        sock = transport.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
        except OSError:
            pass
        self.port = int(sock.getsockname()[1])
        return self.port

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)  # what create_datagram_endpoint makes
        if hasattr(transport, "max_size"):  # asyncio reads each datagram into a buffer this large (256 KiB)
            transport.max_size = beat_wire.MAX_BEAT + 1  # a longer one arrives cut, one byte too long: dropped

    def error_received(self, exc: Exception) -> None:
        log.debug("UDP beat port: %s", exc)  # e.g. ICMP unreachable for a reply to a node gone

    def issue(self, coord: Coordinator, node_id: str, resp: pb.JoinResponse | pb.HeartbeatResponse, *,
              fresh: bool) -> None:
        """Tell a live node the beat port and its key in `resp`: a new key when `fresh` (a Join) or it has none."""
        node = coord.nodes.get(node_id)
        if not self.port or node is None or not node.alive:
            return
        if fresh or node.beat is None:
            node.beat = BeatKey.fresh()
        resp.beat_port = self.port
        resp.beat_key = node.beat.key

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            why = self._beat(data, addr)
        except Exception:  # noqa: BLE001 — nothing a sender does may stop the port
            log.debug("UDP beat from %s", addr, exc_info=True)
            why = "error"
        if why:
            self.dropped[why] += 1

    def _beat(self, data: bytes, addr: Any) -> str:
        """Renew the lease of the beat's node and answer; else the reason it is dropped."""
        coord = self._server.coord
        if coord is None or not self._server.leading:
            return "standby"
        parsed = beat_wire.parse_beat(data)
        if parsed is None:
            return "malformed"
        node_id, counter = parsed
        node = coord.nodes.get(node_id)
        key = node.beat if node is not None else None
        if node is None or key is None:
            return "unknown"
        if counter <= key.counter:
            return "replay"
        now = time.monotonic()
        if now - key.window_at >= self._window_s:
            key.window_at, key.checks = now, 0
        if key.checks >= CHECKS_PER_INTERVAL:
            return "budget"
        key.checks += 1
        if not key.signer.check_beat(data):
            return "mac"
        key.counter = counter
        known = renew(node, coord.beat_rate)
        self.served += 1
        if self._transport is not None:
            self._transport.sendto(key.signer.reply(counter, known=known), addr)
        return ""
