"""A coordinator that was not scheduled for longer than a lease blames none of its live nodes; a silent node is still lost."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)
BEAT_S, LEASE_S = 0.2, 1.0


async def _hold_loop(seconds: float) -> None:
    time.sleep(seconds)  # the coordinator's process not scheduled: nothing on its loop runs


def _state(stub: pb_grpc.NodeServiceStub, node_id: str) -> pb.NodeState.ValueType:
    nodes = stub.ListNodes(pb.ListNodesRequest(), timeout=10).nodes
    return next(n.state for n in nodes if n.id == node_id)


def test_a_coordinator_held_past_the_lease_keeps_live_nodes_and_still_loses_a_silent_one(start_coordinator) -> None:  # type: ignore[no-untyped-def]
    c = start_coordinator(heartbeat_interval_s=BEAT_S, lease_timeout_s=LEASE_S)
    channel = grpc.insecure_channel(c.address)
    stub = pb_grpc.NodeServiceStub(channel)
    node_id = stub.Join(pb.JoinRequest(name="n", address="127.0.0.1", cpus=1), timeout=10).node_id
    stream = stub.WatchAssignments(pb.WatchAssignmentsRequest(node_id=node_id))
    beating = threading.Event()
    beating.set()
    done = threading.Event()

    def beat() -> None:  # the node's heartbeats, on time whatever the coordinator does
        while not done.wait(BEAT_S):
            if beating.is_set():
                try:
                    stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=10)
                except grpc.RpcError:
                    pass

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        coord = c.server.coord
        deadline = time.monotonic() + 30
        while coord.blind is None:  # the reaper has swept once
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = coord.blind.total
        asyncio.run_coroutine_threadsafe(_hold_loop(2.0 * LEASE_S), c.loop).result(30)
        watched_until = time.monotonic() + 2.0 * LEASE_S  # long enough for the reaper to judge it
        while time.monotonic() < watched_until:
            assert _state(stub, node_id) != pb.NODE_STATE_LOST, "a live node was blamed for the coordinator's hold"
            time.sleep(0.05)
        assert coord.blind.total - before >= 1.5 * LEASE_S, (before, coord.blind.total)
        # The node falls silent (its stream stays open, as across a partition): lost after a lease.
        beating.clear()
        t0 = time.monotonic()
        while _state(stub, node_id) != pb.NODE_STATE_LOST:
            assert time.monotonic() - t0 < 30, "a silent node was never declared lost"
            time.sleep(0.05)
        assert time.monotonic() - t0 >= LEASE_S - BEAT_S
    finally:
        done.set()
        thread.join(10)
        stream.cancel()
        channel.close()
