"""The node's UDP heartbeats: one authenticated datagram a beat to the coordinator's beat port, with gRPC as the fallback (HeartbeatThread).

The coordinator hands out the port and this node's key in JoinResponse and HeartbeatResponse
(coordinator/udp_beats.py; transport/beat_wire.py the format). gRPC stays authoritative and takes over
whenever UDP does not answer:

* until a beat has been answered (after every new key), each tick heartbeats over gRPC too;
* a tick after `HEDGE_MISSES` ticks in a row without any reply heartbeats over gRPC too (after
  one, when the lease is shorter than `HEDGE_MISSES + 2` intervals), so lost datagrams delay the
  lease by at most that many intervals; such hedges come at most one a third of the lease,
  and a hedge answered late (over an interval) or not at all doubles that gap, up to half the lease;
* `MISSES_TO_PAUSE` such ticks in a row while gRPC answers promptly (UDP blocked, a wrong route,
  a coordinator that restarted or handed over the lead and holds no key for this node): gRPC
  alone for `PAUSE_BEATS` intervals, then UDP is tried again (a new key tries it at once);
* a reply saying the node is not known: gRPC at once (its answer makes the agent join again).

A reply that comes late but comes (an overloaded coordinator) counts as an answer: the node
then adds no gRPC call. Hedging at every late reply, and turning to gRPC alone when gRPC did not
answer promptly either, made an overloaded coordinator's load grow eight-fold (a gRPC Heartbeat
costs it about eight UDP beats): at 10,000 nodes a few seconds of CPU starvation became a
collapse, 5,000 gRPC calls in flight and nodes declared lost (docs/scale.md). Without a lease
from the Join (`rekey`), a node hedges at every unanswered beat, as it did before.

Used from the heartbeat thread only, but `rekey` (the agent's Join) from any thread.
"""

from __future__ import annotations

import logging
import math
import select
import socket
from collections.abc import Sequence

from gossamer.security.channel import coordinator_addresses
from gossamer.transport import beat_wire

log = logging.getLogger(__name__)

#: Ticks in a row without a reply before a tick heartbeats over gRPC as well (lease permitting).
HEDGE_MISSES = 2
#: Ticks in a row without a reply, gRPC answering meanwhile, before UDP is paused.
MISSES_TO_PAUSE = 3
#: Heartbeat intervals UDP stays paused before it is tried again.
PAUSE_BEATS = 30
#: Beats awaiting their reply that are remembered (a reply to an older one is not taken).
PENDING = 8


class UdpBeats:
    """This node's beat socket, key, counter and fallback state."""

    def __init__(self, coordinator: str | Sequence[str]) -> None:
        hosts = [a.rpartition(":")[0].strip("[]") for a in coordinator_addresses(coordinator)]
        self._hosts = list(dict.fromkeys(hosts))  # several coordinators: whichever leads answers
        self._given: tuple[int, bytes] | None = None  # (port, key) as the coordinator last gave them
        self._port, self._key = 0, b""
        self._signer: beat_wire.Signer | None = None
        self._socks: dict[int, socket.socket] = {}  # by address family
        self._dests: list[tuple[int, tuple[str, int]]] = []  # (family, address) beats go to
        self._counter = 0  # never reset: a new key starts the coordinator's count at 0
        self._pending: dict[int, float] = {}  # counter -> monotonic time sent
        self._last = 0  # the counter of the last beat sent this key (0: none)
        self._answered = 0  # ... and of the last one answered
        self._misses = 0
        self._paused_until = 0.0
        self._urgent = False  # a reply said "not known": heartbeat over gRPC now
        self._lease_s = 0.0  # the coordinator's lease, from the Join (0: not known, hedge at the first miss)
        self._grpc_answered = False  # a gRPC Heartbeat was answered promptly since the last UDP reply
        self._hedged_at = -math.inf  # when the last gRPC hedge went (the keyed phase's hedges not counted)
        self._hedge_gap = 0.0  # the least time between hedges now (0: the base one)
        self._working = False  # a beat was answered under this key (for the logs)
        self._warned = False

    def rekey(self, port: int, key: bytes, lease_s: float = 0.0) -> None:
        """The beat port and key from a JoinResponse or HeartbeatResponse (port 0: the coordinator has none),
        and the lease from a JoinResponse (0: as before)."""
        self._given = (port, key) if port and len(key) == beat_wire.KEY_BYTES else None
        self._lease_s = lease_s or self._lease_s

    def grpc_done(self, took_s: float, *, answered: bool, interval: float) -> None:
        """A gRPC Heartbeat took `took_s` and was `answered` (known) or not.

        Answered within an interval: the coordinator is up and keeping up, so beats unanswered
        meanwhile say UDP is blocked. Late or not at all: it is overloaded or away, and the next
        hedge waits twice as long.
        """
        if answered and took_s < interval:
            self._grpc_answered = True
            self._hedge_gap = 0.0
        else:
            # At most half the lease: two hedges in every lease, so one lost in a coordinator's restart or
            # answered late never costs the lease (capped at the lease, 21 of 1,500 nodes were lost after a kill -9).
            self._hedge_gap = min(self._lease_s / 2, 2 * max(self._hedge_gap, self._lease_s / 3))

    @property
    def urgent(self) -> bool:
        """A reply said this node is not known: the thread should heartbeat over gRPC now."""
        return self._urgent

    def sockets(self) -> list[socket.socket]:
        """The sockets replies come on (none while no key was given)."""
        return list(self._socks.values()) if self._signer is not None else []

    def beat(self, node_id: str, now: float, interval: float) -> bool:
        """This tick: send the beat when UDP is on; whether gRPC must heartbeat this tick as well."""
        self._take_key()
        self._urgent = False
        if self._signer is None or not node_id or now < self._paused_until:
            return True
        previous_answered = self._last != 0 and self._answered == self._last
        if self._last and not previous_answered:
            self._misses += 1
            if self._misses >= MISSES_TO_PAUSE and self._grpc_answered:
                (log.debug if self._warned else log.warning)(
                    "%d UDP heartbeats unanswered: heartbeating over gRPC, UDP again in %.0f s", self._misses,
                    PAUSE_BEATS * interval)
                self._warned = True
                self._pause(now, interval)
                return True
        if not self._send(node_id, now):
            return True
        if not self._working:
            return True  # UDP is not known to work under this key yet
        hedge_after = HEDGE_MISSES if self._lease_s >= (HEDGE_MISSES + 2) * interval else 1
        if self._misses < hedge_after or now - self._hedged_at < max(self._hedge_gap, self._lease_s / 3):
            return False
        self._hedged_at = now
        return True

    def replies(self, now: float, interval: float) -> list[float]:
        """Send times of the beats answered "known" since the last call (reads without waiting)."""
        out: list[float] = []
        for sock in self.sockets():
            while True:
                try:
                    data, addr = sock.recvfrom(64)
                except OSError:  # BlockingIOError: nothing more; others: nothing to take from them
                    break
                got = self._signer.check_reply(data) if self._signer is not None else None
                if got is None or got[0] not in self._pending:
                    continue  # not ours, forged, or a replay of an answered one
                counter, known = got
                sent = self._pending.pop(counter)
                if not known:  # gRPC says so too, and the agent joins again: a new key resumes UDP
                    self._urgent = True
                    self._pause(now, interval)
                    continue
                self._answered = max(self._answered, counter)
                self._misses = 0
                self._grpc_answered = False
                self._hedge_gap = 0.0
                self._dests = [d for d in self._dests if d[1] == addr[:2]] or self._dests  # whoever answers
                if not self._working:
                    self._working = True
                    log.info("heartbeats over UDP to %s:%d", addr[0], addr[1])
                out.append(sent)
        return out

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()

    # --- internals --------------------------------------------------------------------------
    def _take_key(self) -> None:
        given = self._given
        if given == ((self._port, self._key) if self._key else None):
            return
        self._port, self._key = given if given is not None else (0, b"")
        self._signer = beat_wire.Signer(self._key) if self._key else None
        self._pending.clear()
        self._last = self._answered = self._misses = 0
        self._paused_until = 0.0
        self._working = self._grpc_answered = False
        self._dests = []  # resolved at the first beat, in the heartbeat thread

    def _resolve(self) -> list[tuple[int, tuple[str, int]]]:
        dests = []
        for host in self._hosts:
            try:
                family, _, _, _, addr = socket.getaddrinfo(host, self._port, type=socket.SOCK_DGRAM)[0]
            except (OSError, IndexError):
                continue
            if family not in self._socks:
                sock = socket.socket(family, socket.SOCK_DGRAM)
                sock.setblocking(False)
                self._socks[family] = sock
            dests.append((int(family), (str(addr[0]), int(addr[1]))))
        return dests

    def _send(self, node_id: str, now: float) -> bool:
        assert self._signer is not None
        self._counter += 1
        try:
            data = self._signer.beat(node_id, self._counter)
        except ValueError:  # a node id no beat can carry (Join allows none such): gRPC only
            return False
        if not self._dests:  # resolved again after a pause: the name may point elsewhere now
            self._dests = self._resolve()
        self._last = self._counter
        self._pending[self._counter] = now
        while len(self._pending) > PENDING:
            del self._pending[next(iter(self._pending))]
        for family, addr in self._dests:
            try:
                self._socks[family].sendto(data, addr)
            except OSError:
                pass  # unanswered: counted as a miss at the next tick
        return True

    def _pause(self, now: float, interval: float) -> None:
        self._paused_until = now + PAUSE_BEATS * interval
        self._last = self._answered = self._misses = 0
        self._pending.clear()
        self._working = self._grpc_answered = False
        self._dests = []


def wait_for_replies(socks: list[socket.socket], timeout: float) -> bool:
    """Whether a reply is waiting on `socks` within `timeout` seconds."""
    return bool(select.select(socks, [], [], max(0.0, timeout))[0])
