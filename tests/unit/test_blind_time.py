"""A coordinator that was not scheduled does not count that time against its nodes' leases; a silent node is still lost."""

from __future__ import annotations

import random

import pytest

from gossamer.coordinator.blind_time import BlindTime
from gossamer.coordinator.failover import lease_suspects, lease_verdict
from gossamer.coordinator.records import NodeRec
from gossamer.core.protocol import shard_lease_s
from gossamer.v1 import coordinator_pb2 as pb

LEASE, BEAT, TICK = 4.0, 0.5, 0.5


def _node(last_seen: float) -> NodeRec:
    return NodeRec(id="n", name="n", address="127.0.0.1", spot=False, joined_unix=0.0, last_seen=last_seen)


def _sweeps(blind: BlindTime, times: list[float]) -> None:
    for t in times:
        blind.sweep(t)


def test_punctual_sweeps_find_no_blind_time() -> None:
    blind = BlindTime(tick_s=TICK, keep_s=10.0)
    _sweeps(blind, [i * TICK for i in range(20)])
    assert blind.total == 0.0 and blind.since(0.0) == 0.0


def test_a_late_sweep_is_blind_for_its_lateness_and_only_after_the_moment_asked() -> None:
    blind = BlindTime(tick_s=TICK, keep_s=10.0)
    _sweeps(blind, [0.0, 0.5, 1.0, 4.0, 4.5])  # 1.0 -> 4.0: the process slept 2.5 s
    assert blind.sweep(5.0) == 0.0 and blind.total == pytest.approx(2.5)
    assert blind.since(0.9) == pytest.approx(2.5)  # before the gap: all of it
    assert blind.since(4.2) == 0.0  # after it: none
    assert blind.since(2.5) == pytest.approx(2.5 * 0.5)  # handled halfway through the catching up: its part after


def test_sweeps_older_than_kept_are_dropped_and_counted_whole() -> None:
    blind = BlindTime(tick_s=TICK, keep_s=2.0)
    _sweeps(blind, [0.0, 3.5] + [3.5 + i * TICK for i in range(1, 20)])
    assert blind.since(-100.0) <= blind.total


def test_a_node_silent_only_while_the_coordinator_slept_keeps_its_lease() -> None:
    # The node's last heartbeat was handled at 10.0, then the coordinator was not scheduled for 3.5 s.
    blind = BlindTime(tick_s=TICK, keep_s=2 * LEASE)
    _sweeps(blind, [9.5, 10.0, 14.0])
    plain = lease_verdict(_node(10.0), now=14.6, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT)
    assert plain is not None  # what the reaper used to say: 4.6 s > a 4 s lease
    blind.sweep(14.6)
    assert lease_verdict(_node(10.0), now=14.6, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT,
                         blind_since=blind.since) is None


def test_a_node_silent_beyond_the_lease_while_the_coordinator_watched_is_lost() -> None:
    blind = BlindTime(tick_s=TICK, keep_s=2 * LEASE)
    _sweeps(blind, [9.5, 10.0, 12.0] + [12.0 + i * TICK for i in range(1, 13)])  # 1.5 s blind, then punctual
    now = 18.0
    verdict = lease_verdict(_node(10.0), now=now, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT,
                            blind_since=blind.since)
    assert verdict is not None and "not scheduled for 1.5s" in verdict[0]
    # Lost only once the time the coordinator watched exceeds the lease: later than plain, never earlier.
    assert now - 10.0 - blind.since(10.0) > LEASE
    early = lease_verdict(_node(10.0), now=15.2, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT,
                          blind_since=blind.since)
    assert early is None


def test_a_closed_stream_counts_only_the_time_the_coordinator_watched() -> None:
    blind = BlindTime(tick_s=TICK, keep_s=2 * LEASE)
    node = _node(10.0)
    node.stream_lost_at = 10.1
    _sweeps(blind, [10.0, 12.0])  # slept 1.5 s right after the drop
    assert lease_verdict(node, now=12.0, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT,
                         blind_since=blind.since) is None
    _sweeps(blind, [12.5, 13.0])
    assert lease_verdict(node, now=13.0, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT,
                         blind_since=blind.since) is not None


def test_blind_time_only_delays_a_loss_so_the_node_fences_first() -> None:
    """Fencing: the node's shards stop `shard_lease_s` after sending a heartbeat; the coordinator, counting
    blind time out, declares it lost no sooner than a lease after receiving it, so never before the fence."""
    fence = shard_lease_s(LEASE, BEAT)
    for slept in (0.0, 0.7, 2.0, 5.0):
        blind = BlindTime(tick_s=TICK, keep_s=4 * LEASE)
        sent = received = 10.0
        times = [10.0, 10.5 + slept] + [10.5 + slept + i * TICK for i in range(1, 40)]
        lost_at = None
        for t in times:
            blind.sweep(t)
            if lease_verdict(_node(received), now=t, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT,
                             blind_since=blind.since):
                lost_at = t
                break
        assert lost_at is not None, slept  # still detected
        assert lost_at - sent > fence, (slept, lost_at)
        assert lost_at - received >= LEASE + slept - 1e-9, (slept, lost_at)


def test_a_hold_before_the_first_sweep_is_measured_from_the_start() -> None:
    blind = BlindTime(tick_s=TICK, keep_s=10.0, start=0.0)
    assert blind.sweep(3.0) == pytest.approx(2.5)  # held 2.5 s before the reaper ever swept
    assert lease_verdict(_node(0.0), now=4.6, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT,
                         blind_since=blind.since) is None


def test_lease_suspects_are_every_node_a_verdict_could_remove_and_no_other() -> None:
    rng = random.Random(0)
    nodes = []
    for i in range(400):
        n = _node(rng.uniform(0.0, 20.0))
        n.id, n.state = f"n{i}", rng.choice([pb.NODE_STATE_READY, pb.NODE_STATE_BUSY, pb.NODE_STATE_LOST])
        n.stream_lost_at = rng.choice([0.0, 0.0, rng.uniform(0.0, 20.0)])
        nodes.append(n)
    open_ids = {n.id for n in nodes if rng.random() < 0.7}
    now = 20.0
    connected, suspects = lease_suspects(nodes, now=now, lease_timeout_s=LEASE, is_open=open_ids.__contains__)
    assert connected == sum(n.alive and n.id in open_ids for n in nodes)
    removable = [n for n in nodes
                 if lease_verdict(n, now=now, lease_timeout_s=LEASE, heartbeat_interval_s=BEAT) is not None]
    assert removable and set(map(id, removable)) <= set(map(id, suspects))
    assert all(n.alive and (n.stream_lost_at or now - n.last_seen > LEASE) for n in suspects)
