"""The coordinator never blames nodes for its own backlog: leases hold while it is behind; closed streams still count."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gossamer.coordinator.beat_rate import BeatRate
from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.core import Coordinator
from gossamer.v1 import coordinator_pb2 as pb


def test_beat_rate_is_behind_only_when_it_serves_less_than_the_share_due() -> None:
    rate = BeatRate(interval_s=1.0, window_s=10.0)
    assert not rate.behind(0.0, 100, lag_s=0.5)
    rate.served += 250  # 100 nodes for 3 s: 300 due
    assert not rate.behind(3.0, 100, lag_s=0.5)
    rate.served += 100  # 350 of 600 due by t=6
    assert rate.behind(6.0, 100, lag_s=0.5)


def test_silent_nodes_on_a_punctual_loop_are_not_the_coordinator_falling_behind() -> None:
    rate = BeatRate(interval_s=1.0, window_s=10.0)
    rate.behind(0.0, 100, lag_s=0.01)
    assert not rate.behind(6.0, 100, lag_s=0.01)  # nothing served, but the loop is on time: nodes are silent


def test_beat_rate_needs_two_intervals_before_judging() -> None:
    rate = BeatRate(interval_s=1.0, window_s=10.0)
    rate.behind(0.0, 100)
    assert not rate.behind(1.5, 100)


def _silent_pair(tmp_path: Path, served: int) -> tuple[pb.NodeState.ValueType, pb.NodeState.ValueType]:
    async def go() -> tuple[pb.NodeState.ValueType, pb.NodeState.ValueType]:
        c = Coordinator(CoordinatorConfig(state_dir=str(tmp_path), check_imports=False, heartbeat_interval_s=0.5,
                                          lease_timeout_s=2.0))
        ids = [(await c.join(pb.JoinRequest(name=f"n{i}", address="127.0.0.1"))).node_id for i in range(10)]
        now = time.time()
        c.beat_rate.behind(now - 2.0, 10, lag_s=1.0)  # the window opens 2 s ago, the loop late
        c.beat_rate.served += served
        with_stream, without = ids[0], ids[1]
        for node_id in ids:
            if node_id != without:
                c.stream_changed(node_id, is_open=True)
        for node_id in (with_stream, without):
            c.nodes[node_id].last_seen = now - 3.0  # silent past the 2 s lease
        await c.reap_leases(lag_s=1.0)
        states = c.nodes[with_stream].state, c.nodes[without].state
        c.store.close()
        return states

    return asyncio.run(go())


def test_while_behind_no_lease_expires(tmp_path: Path) -> None:
    with_stream, without = _silent_pair(tmp_path, served=5)  # 36 due from the 9 nodes with an open stream
    assert with_stream != pb.NODE_STATE_LOST
    assert without != pb.NODE_STATE_LOST


def test_while_behind_a_closed_stream_still_counts(tmp_path: Path) -> None:
    async def go() -> pb.NodeState.ValueType:
        c = Coordinator(CoordinatorConfig(state_dir=str(tmp_path), check_imports=False, heartbeat_interval_s=0.5,
                                          lease_timeout_s=2.0))
        ids = [(await c.join(pb.JoinRequest(name=f"n{i}", address="127.0.0.1"))).node_id for i in range(4)]
        for node_id in ids:
            c.stream_changed(node_id, is_open=True)
        now = time.time()
        c.beat_rate.behind(now - 2.0, 4, lag_s=1.0)  # nothing served since, the loop late: behind
        c.stream_changed(ids[0], is_open=False)
        c.nodes[ids[0]].stream_lost_at = c.nodes[ids[0]].last_seen = now - 1.5  # closed, 3 intervals quiet
        await c.reap_leases(lag_s=1.0)
        state = c.nodes[ids[0]].state
        c.store.close()
        return state

    assert asyncio.run(go()) == pb.NODE_STATE_LOST


def test_when_keeping_up_an_expired_lease_is_lost_even_with_an_open_stream(tmp_path: Path) -> None:
    with_stream, without = _silent_pair(tmp_path, served=40)
    assert with_stream == pb.NODE_STATE_LOST
    assert without == pb.NODE_STATE_LOST
