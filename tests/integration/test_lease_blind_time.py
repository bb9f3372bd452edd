"""Load does not make a live node lost: a coordinator held past a lease blames none, an agent's held loop delays no heartbeat."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from gossamer.node.heartbeat import HeartbeatThread
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


def test_heartbeats_go_on_while_the_agents_loop_is_held(start_coordinator) -> None:  # type: ignore[no-untyped-def]
    """The agent's loop is held while it starts role processes; its heartbeats (HeartbeatThread) are not."""
    c = start_coordinator(heartbeat_interval_s=BEAT_S, lease_timeout_s=LEASE_S)
    channel = grpc.insecure_channel(c.address)
    stub = pb_grpc.NodeServiceStub(channel)
    node_id = stub.Join(pb.JoinRequest(name="n", address="127.0.0.1", cpus=1), timeout=10).node_id
    agent_loop = asyncio.new_event_loop()
    runner = threading.Thread(target=agent_loop.run_forever, daemon=True)
    runner.start()
    answers: list[tuple[float, bool]] = []
    beats = HeartbeatThread(c.address, None, node_id=lambda: node_id, interval=lambda: BEAT_S,
                            on_answer=lambda sent, known: answers.append((sent, known is True)), loop=agent_loop)
    beats.start()
    try:
        deadline = time.monotonic() + 30
        while not answers:
            assert time.monotonic() < deadline, "no heartbeat answered"
            time.sleep(0.05)
        held = asyncio.run_coroutine_threadsafe(_hold_loop(3.0 * LEASE_S), agent_loop)
        while not held.done():
            assert _state(stub, node_id) != pb.NODE_STATE_LOST, "heartbeats waited on the agent's held loop"
            time.sleep(0.05)
        held.result()
        t_free = time.monotonic()
        while not any(sent > t_free - 3.0 * LEASE_S for sent, _ in answers):
            assert time.monotonic() - t_free < 30, "the answers sent while the loop was held never reached it"
            time.sleep(0.05)
        assert all(known for _, known in answers)
    finally:
        beats.stop()
        agent_loop.call_soon_threadsafe(agent_loop.stop)
        runner.join(10)
        channel.close()
