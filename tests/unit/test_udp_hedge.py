"""The node's UDP beats against a coordinator that answers late or not at all (node/beat_sender.py), over real UDP sockets.

Late replies must add no gRPC call (hedging at each one multiplied an overloaded coordinator's
load eight-fold); silence brings gRPC in within HEDGE_MISSES ticks, spaced out by the lease and
further when gRPC is slow too; UDP pauses only while gRPC answers promptly.
"""

from __future__ import annotations

import secrets
import socket

from gossamer.node.beat_sender import HEDGE_MISSES, PAUSE_BEATS, UdpBeats, wait_for_replies
from gossamer.transport import beat_wire

NODE = "n1"


class _BeatPort:
    """The coordinator's side: a UDP socket that answers the beats it got when the test says so."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.key = secrets.token_bytes(beat_wire.KEY_BYTES)
        self.signer = beat_wire.Signer(self.key)
        self.waiting: list[tuple[int, tuple[str, int]]] = []  # (counter, sender) of beats not answered yet

    def take(self) -> int:
        """The next beat (waits up to 10 s for it): its counter."""
        self.sock.settimeout(10)
        data, addr = self.sock.recvfrom(256)
        parsed = beat_wire.parse_beat(data)
        assert parsed is not None and parsed[0] == NODE and self.signer.check_beat(data)
        self.waiting.append((parsed[1], addr))
        return parsed[1]

    def answer_all(self) -> None:
        for counter, addr in self.waiting:
            self.sock.sendto(self.signer.reply(counter, known=True), addr)
        self.waiting.clear()

    def close(self) -> None:
        self.sock.close()


def _read(udp: UdpBeats, now: float, replies: int) -> None:
    """Take `replies` replies off the node's socket (as its heartbeat thread does between ticks)."""
    got = 0
    while got < replies:
        assert wait_for_replies(udp.sockets(), 10), "no reply came"
        got += len(udp.replies(now, 1.0))


def _keyed(lease_s: float) -> tuple[_BeatPort, UdpBeats]:
    port = _BeatPort()
    udp = UdpBeats(f"127.0.0.1:{port.port}")
    udp.rekey(port.port, port.key, lease_s=lease_s)
    assert udp.beat(NODE, 0.0, 1.0), "before any answer under a key, gRPC heartbeats too"
    port.take()
    port.answer_all()
    _read(udp, 0.5, 1)
    return port, udp


def test_replies_a_tick_late_add_no_grpc_heartbeat() -> None:
    port, udp = _keyed(lease_s=10.0)
    try:
        asked = []
        for t in range(1, 12):
            asked.append(udp.beat(NODE, float(t), 1.0))
            port.take()
            if len(port.waiting) == 2:  # the previous beat is answered only now, after this one went
                counter, addr = port.waiting.pop(0)
                port.sock.sendto(port.signer.reply(counter, known=True), addr)
                _read(udp, t + 0.5, 1)
        assert asked == [False] * 11
    finally:
        udp.close()
        port.close()


def test_silence_brings_grpc_in_spaced_out_and_udp_pauses_only_once_grpc_answers_promptly() -> None:
    lease = 9.0  # hedges at most every lease / 3 = 3 s, a late one doubles that, up to lease / 2 = 4.5 s
    port, udp = _keyed(lease_s=lease)
    try:
        asked, counters = [], []
        ticks = range(1, 15)
        for t in ticks:  # the coordinator is silent on UDP from beat 1 on: beats go on, gRPC comes in
            asked.append(udp.beat(NODE, float(t), 1.0))
            counters.append(port.take())
            if t == 6:
                udp.grpc_done(2.5, answered=True, interval=1.0)  # answered, but late: overloaded, not blocked
        # Beat 1 unanswered at tick 2, beat 2 at tick 3 (HEDGE_MISSES): gRPC then, again 3 s later, then 4.5 s
        # (twice 3 s, capped at half the lease: two hedges in every lease).
        assert [t for t, a in zip(ticks, asked, strict=True) if a] == [1 + HEDGE_MISSES, 4 + HEDGE_MISSES, 9 + HEDGE_MISSES]
        assert counters == list(range(counters[0], counters[0] + len(ticks)))  # no pause: gRPC was not prompt
        udp.grpc_done(0.05, answered=True, interval=1.0)  # gRPC answers at once while UDP does not: UDP is blocked
        assert udp.beat(NODE, 15.0, 1.0)
        assert udp.beat(NODE, 16.0, 1.0)  # paused: gRPC alone
        assert udp.beat(NODE, 15.0 + PAUSE_BEATS, 1.0)  # UDP again, gRPC with it until a beat is answered
        assert port.take() == counters[-1] + 1  # nothing was sent while paused
    finally:
        udp.close()
        port.close()


def test_a_short_lease_hedges_at_the_first_silent_tick() -> None:
    port, udp = _keyed(lease_s=(HEDGE_MISSES + 2) * 1.0 - 0.5)
    try:
        assert not udp.beat(NODE, 1.0, 1.0)
        port.take()
        assert udp.beat(NODE, 2.0, 1.0)  # its previous beat got no reply: gRPC now, not a tick later
    finally:
        udp.close()
        port.close()
