"""UDP heartbeats against a real coordinator: beats alone hold a lease, forged ones renew nothing, and a node
whose UDP is blocked, or whose coordinator restarted, heartbeats over gRPC and is never lost."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gossamer.coordinator.udp_beats import CHECKS_PER_INTERVAL
from gossamer.node.beat_sender import UdpBeats
from gossamer.node.heartbeat import HeartbeatThread
from gossamer.transport.beat_wire import Signer
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._relay import TcpRelay

pytestmark = pytest.mark.timeout(120)
BEAT_S, LEASE_S = 0.2, 1.5


def _state(stub: pb_grpc.NodeServiceStub, node_id: str) -> pb.NodeState.ValueType:
    nodes = stub.ListNodes(pb.ListNodesRequest(), timeout=10).nodes
    return next(n.state for n in nodes if n.id == node_id)


def _wait(what: str, done: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _reply(sock: socket.socket, timeout: float) -> bytes | None:
    sock.settimeout(timeout)
    try:
        return sock.recvfrom(64)[0]
    except TimeoutError:
        return None


def test_udp_beats_alone_hold_a_lease_and_forged_ones_renew_nothing(start_coordinator, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("DEBUG", logger="gossamer")
    c = start_coordinator(heartbeat_interval_s=BEAT_S, lease_timeout_s=LEASE_S, http=True)
    channel = grpc.insecure_channel(c.address)
    stub = pb_grpc.NodeServiceStub(channel)
    joined = stub.Join(pb.JoinRequest(name="n", address="127.0.0.1", cpus=1), timeout=10)
    node_id, key = joined.node_id, joined.beat_key
    assert joined.beat_port and len(key) == 32
    signer, port = Signer(key), ("127.0.0.1", joined.beat_port)
    beats = c.server.beats
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # Three leases on UDP beats alone (no gRPC Heartbeat): each answered, the node stays ready.
        counter, until = 0, time.monotonic() + 3 * LEASE_S
        while time.monotonic() < until:
            counter += 1
            sock.sendto(signer.beat(node_id, counter), port)
            assert signer.check_reply(_reply(sock, 10.0) or b"") == (counter, True)
            assert _state(stub, node_id) == pb.NODE_STATE_READY
            time.sleep(BEAT_S)
        assert beats.served == counter and not any(beats.dropped.values()), beats.dropped
        valid = signer.beat(node_id, counter)

        # A coordinator that does not lead renews nothing, even for a valid beat.
        c.server.leading = False
        sock.sendto(signer.beat(node_id, counter + 1), port)
        _wait("the standby's drop", lambda: beats.dropped["standby"] == 1)
        c.server.leading = True

        # Forgeries at several times the beat rate: none answered, and the lease runs out.
        rng = random.Random(18)
        other = Signer(bytes(32))
        served, replays = beats.served, [valid, signer.beat(node_id, counter - 1)]
        last_valid, counter = time.monotonic(), counter + 1
        while _state(stub, node_id) != pb.NODE_STATE_LOST:
            assert time.monotonic() - last_valid < 10 * LEASE_S, "forged beats kept the node alive"
            counter += 10
            forged = [*replays, *(other.beat(node_id, counter + k) for k in range(10)),  # another key
                      signer.beat("nobody", counter), b"", b"\x01B" + bytes(1000),  # unknown, malformed
                      bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100)))]
            for data in forged:
                sock.sendto(data, port)
            assert _reply(sock, BEAT_S) is None, "a forged beat was answered"
        assert time.monotonic() - last_valid >= LEASE_S - BEAT_S
        assert beats.served == served

        # Still serving: the node, now lost, is told so over UDP (authenticated) and over gRPC. (Its
        # first beats may fall in a window whose MAC checks the forgeries used up: tried again.)
        answer = None
        for _ in range(50):
            counter += 100
            sock.sendto(signer.beat(node_id, counter), port)
            if answer := _reply(sock, 0.5):
                break
        assert signer.check_reply(answer or b"") == (counter, False)
        dropped = dict(beats.dropped)  # datagrams are served in order: every forgery is counted by now
        for reason in ("replay", "mac", "budget", "unknown", "malformed"):
            assert dropped[reason] > 0, (reason, dropped)
        windows = (time.monotonic() - last_valid) / BEAT_S + 2
        assert dropped["mac"] <= CHECKS_PER_INTERVAL * windows, dropped  # the HMACs a flood costs are bounded
        assert not stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=10).known
        metrics = urllib.request.urlopen(f"{c.base}/metrics", timeout=10).read().decode()
        assert f'gossamer_udp_beats_dropped_total{{reason="mac"}} {float(dropped["mac"])}' in metrics
        # The key is in no listing, metric, event or log line.
        events = pb_grpc.ExperimentServiceStub(channel).ListEvents(pb.ListEventsRequest(), timeout=10)
        shown = [stub.ListNodes(pb.ListNodesRequest(), timeout=10).SerializeToString(), events.SerializeToString(),
                 metrics.encode(), caplog.text.encode()]
        assert not any(key in s or key.hex().encode() in s or repr(key).encode() in s for s in shown)
    finally:
        sock.close()
        channel.close()


class _Node:
    """The node agent's heartbeat thread with its UDP beats, keyed by a Join through `address`."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        joined = pb_grpc.NodeServiceStub(self.channel).Join(
            pb.JoinRequest(name="n", address="127.0.0.1", cpus=1), timeout=10)
        self.id = joined.node_id
        self.udp = UdpBeats(address)
        self.udp.rekey(joined.beat_port, joined.beat_key, lease_s=joined.lease_timeout_s)  # as the agent does
        self.answers: list[bool | grpc.RpcError] = []
        self.loop = asyncio.new_event_loop()
        self._runner = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner.start()
        self.beats = HeartbeatThread(address, None, node_id=lambda: self.id, interval=lambda: BEAT_S,
                                     on_answer=lambda sent, answer: self.answers.append(answer), loop=self.loop,
                                     udp=self.udp)
        self.beats.start()

    def close(self) -> None:
        self.beats.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._runner.join(10)
        self.channel.close()


def _grpc_beats(c) -> int:  # type: ignore[no-untyped-def]
    """Heartbeats `c` served over gRPC: every one served (beat_rate) less those over UDP, both read on the
    coordinator's loop (read from here, a beat served between the two reads counts in one and not the other)."""
    async def read() -> int:
        return int(c.server.coord.beat_rate.served - c.server.beats.served)

    return int(c.call(read()))


def test_a_node_whose_udp_is_blocked_heartbeats_over_grpc_and_is_not_lost(start_coordinator) -> None:  # type: ignore[no-untyped-def]
    c = start_coordinator(heartbeat_interval_s=BEAT_S, lease_timeout_s=LEASE_S)
    relay = TcpRelay("127.0.0.2", c.port)  # the node dials 127.0.0.2; the beat port listens on 127.0.0.1 only
    node = _Node(relay.address)
    stub = pb_grpc.NodeServiceStub(node.channel)
    try:
        until = time.monotonic() + 4 * LEASE_S
        while time.monotonic() < until:
            assert _state(stub, node.id) == pb.NODE_STATE_READY, "a node with its UDP blocked was lost"
            time.sleep(0.1)
        assert c.server.beats.served == 0 and not any(c.server.beats.dropped.values())
        assert _grpc_beats(c) >= 0.5 * 4 * LEASE_S / BEAT_S, _grpc_beats(c)
        assert node.answers.count(True) >= 5 and False not in node.answers, node.answers
    finally:
        node.close()
        relay.close()


def test_udp_takes_over_and_a_restarted_coordinator_rekeys_the_node_over_grpc(start_coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lease = 3.0  # room for the gRPC channel to reconnect through the relay to the restarted coordinator
    first = start_coordinator(tmp_path / "state", heartbeat_interval_s=BEAT_S, lease_timeout_s=lease)
    relay = TcpRelay("127.0.0.1", first.port)  # same host: the beats go straight to the beat port
    node = _Node(relay.address)
    try:
        _wait("UDP beats", lambda: first.server.beats.served >= 5)
        on_grpc = _grpc_beats(first)
        _wait("more UDP beats", lambda: first.server.beats.served >= 15)
        assert _grpc_beats(first) == on_grpc, "gRPC heartbeats went on while UDP answered"

        first.close()  # its keys die with it: the restarted one holds none
        relay.drop_connections()
        second = start_coordinator(tmp_path / "state", heartbeat_interval_s=BEAT_S, lease_timeout_s=lease)
        relay.target = second.port
        _wait("UDP beats to the restarted coordinator", lambda: second.server.beats.served >= 5)
        assert _grpc_beats(second) >= 1  # the Heartbeat that gave the node its new key
        stub = pb_grpc.NodeServiceStub(node.channel)
        assert _state(stub, node.id) == pb.NODE_STATE_READY
        assert False not in node.answers, "the node was declared lost across the restart"
    finally:
        node.close()
        relay.close()


def test_with_udp_beats_off_no_port_or_key_is_given_and_heartbeats_stay_on_grpc(start_coordinator) -> None:  # type: ignore[no-untyped-def]
    c = start_coordinator(heartbeat_interval_s=BEAT_S, lease_timeout_s=LEASE_S, udp_beats=False)
    with grpc.insecure_channel(c.address) as channel:
        stub = pb_grpc.NodeServiceStub(channel)
        joined = stub.Join(pb.JoinRequest(name="n", address="127.0.0.1", cpus=1), timeout=10)
        beat = stub.Heartbeat(pb.HeartbeatRequest(node_id=joined.node_id), timeout=10)
    assert (joined.beat_port, joined.beat_key, beat.beat_port, beat.beat_key) == (0, b"", 0, b"")
    assert beat.known and c.server.beats.port == 0
