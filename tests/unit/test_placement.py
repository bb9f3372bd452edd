"""Placement and failover policy of the coordinator, as pure functions over its records (no gRPC, no store)."""

from __future__ import annotations

from typing import Any

import pytest

from gossamer.coordinator.failover import (
    DropWorker,
    PromoteBackup,
    ReplaceBackup,
    RestoreShard,
    gives_up,
    lease_verdict,
    recovery_for,
    replacement_order,
    restore_outcome,
    roll_back_together,
)
from gossamer.coordinator.placement import (
    StartOverdue,
    cluster_too_small,
    free_nodes,
    grow,
    lead_node,
    missing_shards,
    overdue,
    place,
    place_experiment,
    replica_host,
    shard_host,
    shards_ready,
    start_overdue,
    wait_reason,
    waiting_for,
)
from gossamer.coordinator.records import NodeRec, RoleRec
from gossamer.core.modes import resolve
from gossamer.core.protocol import RESTORE_SEEDING
from gossamer.v1 import coordinator_pb2 as pb

PS, WORKER = pb.ROLE_PARAMETER_SERVER, pb.ROLE_WORKER
SERVING = pb.ROLE_STATE_SERVING


def _node(i: int, *, spot: bool = False, **kw: Any) -> NodeRec:
    return NodeRec(id=f"n{i}", name=f"n{i}", address="127.0.0.1", spot=spot, joined_unix=float(i), **kw)


def _spec(shards: int = 2, min_workers: int = 2, max_workers: int = 4) -> dict[str, Any]:
    return {"num_ps_shards": shards, "min_workers": min_workers, "max_workers": max_workers}


def _shard(node: str, index: int, replica: int = 0, *, serving: bool = True, replicated: bool = False) -> RoleRec:
    return RoleRec(node_id=node, role=PS, index=index, replica=replica, replicated=replicated,
                   state=SERVING if serving else pb.ROLE_STATE_STARTING, endpoint=f"tcp://{node}:1" if serving else "")


# --- placement ---------------------------------------------------------------------------------
def test_an_experiment_needs_its_shards_plus_min_workers_and_a_serverless_mode_no_shards() -> None:
    nodes = [_node(i) for i in range(3)]
    assert place_experiment(nodes, _spec(shards=2, min_workers=2), resolve("async")) is None
    gossip = place_experiment(nodes, _spec(shards=2, min_workers=2), resolve("gossip"))
    assert gossip is not None and gossip.servers == [] and len(gossip.workers) == 3
    diloco = place_experiment(nodes, _spec(shards=1, min_workers=2), resolve("diloco", "gossip"))
    assert diloco is not None and diloco.servers == []
    sync = place_experiment(nodes, _spec(shards=1, min_workers=2), resolve("sync"))
    assert sync is not None and [n.id for n in sync.servers] == ["n0"]


def test_only_live_nodes_without_an_experiment_are_free() -> None:
    nodes = [_node(0), _node(1, experiment_id="e"), _node(2, state=pb.NODE_STATE_LOST), _node(3)]
    assert [n.id for n in free_nodes(nodes)] == ["n0", "n3"]


def test_a_new_replica_goes_to_another_server_node_then_a_free_node_then_a_worker_never_beside_its_twin() -> None:
    nodes = {n.id: n for n in (_node(0), _node(1), _node(2, spot=True), _node(3))}
    roles = [_shard("n0", 0), _shard("n1", 1), RoleRec(node_id="n2", role=WORKER, index=0)]
    host = shard_host(roles, 0, nodes, free=[nodes["n3"]])
    assert host is not None and host.id == "n1"  # the other shard's node
    host = shard_host(roles[:1] + roles[2:], 0, nodes, free=[nodes["n3"]])
    assert host is not None and host.id == "n3"  # no other server: a free node
    host = shard_host(roles[:1] + roles[2:], 0, nodes, free=[])
    assert host is not None and host.id == "n2"  # else a worker's node
    assert shard_host([_shard("n0", 0), _shard("n2", 0, 1)], 0, nodes, free=[]) is None


def test_the_lead_is_the_lowest_indexed_worker() -> None:
    roles = [RoleRec(node_id="a", role=WORKER, index=3), _shard("p", 0), RoleRec(node_id="b", role=WORKER, index=1)]
    assert lead_node(roles) == "b"
    assert lead_node([_shard("p", 0)]) == ""


def test_an_experiment_runs_once_every_shard_serves_and_every_backup_is_synced() -> None:
    assert not shards_ready([_shard("a", 0)], num_shards=2)
    assert not shards_ready([_shard("a", 0), _shard("b", 1, serving=False)], num_shards=2)
    assert shards_ready([_shard("a", 0), _shard("b", 1)], num_shards=2)
    with_backup = [_shard("a", 0), _shard("b", 0, 1)]
    assert not shards_ready(with_backup, num_shards=1)
    with_backup[0].replicated = True
    assert shards_ready(with_backup, num_shards=1)


# --- failure detection -------------------------------------------------------------------------
def test_a_node_is_lost_when_its_lease_expires() -> None:
    node = _node(0, last_seen=100.0)
    assert lease_verdict(node, now=104.0, lease_timeout_s=5.0, heartbeat_interval_s=1.0) is None
    verdict = lease_verdict(node, now=105.5, lease_timeout_s=5.0, heartbeat_interval_s=1.0)
    assert verdict is not None and verdict[0].startswith("lease expired") and verdict[1] == 5.5


def test_a_dropped_stream_with_two_quiet_heartbeat_intervals_is_a_loss_but_a_heartbeat_since_is_not() -> None:
    node = _node(0, last_seen=100.0, stream_lost_at=100.5)
    assert lease_verdict(node, now=102.0, lease_timeout_s=30.0, heartbeat_interval_s=1.0) is None
    verdict = lease_verdict(node, now=102.6, lease_timeout_s=30.0, heartbeat_interval_s=1.0)
    assert verdict is not None and verdict[0].startswith("connection closed")
    node.last_seen = 101.0  # it heartbeat after the drop: alive, reconnecting
    assert lease_verdict(node, now=102.6, lease_timeout_s=30.0, heartbeat_interval_s=1.0) is None


def test_a_heartbeat_handled_after_the_drop_postpones_the_loss_but_does_not_cancel_it() -> None:
    # kill -9 right after a heartbeat: on a busy coordinator the heartbeat may be handled after
    # the stream's end. Two quiet intervals after it, the node is lost (not a lease later).
    node = _node(0, last_seen=100.7, stream_lost_at=100.5)
    assert lease_verdict(node, now=102.6, lease_timeout_s=30.0, heartbeat_interval_s=1.0) is None
    verdict = lease_verdict(node, now=102.8, lease_timeout_s=30.0, heartbeat_interval_s=1.0)
    assert verdict is not None and verdict[0].startswith("connection closed")


def test_a_node_already_gone_is_not_lost_again() -> None:
    node = _node(0, last_seen=0.0, state=pb.NODE_STATE_LEFT)
    assert lease_verdict(node, now=1000.0, lease_timeout_s=5.0, heartbeat_interval_s=1.0) is None


# --- recovery ----------------------------------------------------------------------------------
def test_lost_primaries_are_replaced_before_backups_and_workers_last() -> None:
    worker, backup, primary = RoleRec(node_id="a", role=WORKER, index=0), _shard("a", 0, 1), _shard("a", 1)
    assert replacement_order([worker, backup, primary]) == [primary, backup, worker]


def test_a_lost_worker_is_dropped() -> None:
    assert isinstance(recovery_for(RoleRec(node_id="a", role=WORKER, index=0), []), DropWorker)


def test_a_lost_backup_leaves_its_primary_unreplicated_until_a_new_backup_syncs() -> None:
    primary = _shard("a", 0, replicated=True)
    recovery = recovery_for(_shard("b", 0, 1), [primary, _shard("c", 1)])
    assert isinstance(recovery, ReplaceBackup) and recovery.unreplicated == (primary,)


def test_a_lost_primary_with_a_synced_serving_backup_promotes_it() -> None:
    backup = _shard("b", 0, 1)
    recovery = recovery_for(_shard("a", 0, replicated=True), [backup])
    assert isinstance(recovery, PromoteBackup) and recovery.backup is backup


def test_a_lost_primary_whose_backup_is_unsynced_or_not_serving_restores_from_the_checkpoint() -> None:
    unsynced = _shard("b", 0, 1)
    recovery = recovery_for(_shard("a", 0, replicated=False), [unsynced])
    assert isinstance(recovery, RestoreShard) and recovery.stale == (unsynced,)
    starting = _shard("b", 0, 1, serving=False)
    recovery = recovery_for(_shard("a", 0, replicated=True), [starting])
    assert isinstance(recovery, RestoreShard) and recovery.stale == (starting,)
    recovery = recovery_for(_shard("a", 0), [_shard("c", 1)])
    assert isinstance(recovery, RestoreShard) and recovery.stale == ()


def test_a_shard_seeding_waits_for_workers_copies_only_while_a_worker_is_left_to_send_one() -> None:
    shard = _shard("n", 0)
    worker = RoleRec(node_id="w", role=WORKER, index=0)
    kind, message, lost = restore_outcome([shard, worker], shard, index=0, version=0, source=RESTORE_SEEDING,
                                          last=185) or ("", "", -1)
    assert (kind, lost) == ("restore", 0) and "freshest worker's copy" in message
    # No worker left: no copy can come (a new worker holds the initial values), so it is a restore
    # from initial values now, not after the seeding deadline.
    kind, message, lost = restore_outcome([shard], shard, index=0, version=0, source=RESTORE_SEEDING,
                                          last=185) or ("", "", -1)
    assert (kind, lost) == ("restored", 185) and "no worker left to hold a copy" in message
    assert restore_outcome([shard, worker], shard, index=0, version=7, source="", last=9) is None
    assert restore_outcome([shard], shard, index=0, version=190, source="/ck/step-190", last=185)[:1] == ("restored",)


def test_a_rebuild_from_the_workers_copies_says_the_exact_count_or_why_it_is_not_known() -> None:
    shard = _shard("n", 0)
    kind, message, lost = restore_outcome([shard], shard, index=0, version=6424, source="worker w:0's copy",
                                          last=5046, counted=3) or ("", "", -1)
    assert (kind, lost) == ("restored", 3) and "3 version(s) lost, counted exactly" in message, message
    kind, message, lost = restore_outcome([shard], shard, index=0, version=6424, source="worker w:0's copy",
                                          last=5046, counted=3, unknown="1 worker(s) sent no copy (w:2)") or ("", "", -1)
    assert lost == 3 and "at least 3 version(s) lost" in message, message
    assert "not known yet: 1 worker(s) sent no copy (w:2)" in message, message


def test_in_a_barrier_mode_every_shard_rolls_back_with_a_restored_one() -> None:
    roles = [_shard("a", 0), _shard("b", 2), RoleRec(node_id="w", role=WORKER, index=5)]
    assert roll_back_together(roles, 1, barrier=resolve("sync").barrier) == [0, 1, 2]
    assert roll_back_together(roles, 1, barrier=resolve("diloco", "sync").barrier) == [0, 1, 2]
    assert roll_back_together(roles, 1, barrier=resolve("async").barrier) == [1]


def test_the_failure_budget_is_ten_or_three_per_worker_whichever_is_more() -> None:
    assert not gives_up(10, max_workers=2) and gives_up(11, max_workers=2)
    assert not gives_up(12, max_workers=4) and gives_up(13, max_workers=4)


# --- why a queued experiment waits ------------------------------------------------------------------
def test_the_wait_reason_names_what_the_experiment_needs_and_what_is_free() -> None:
    nodes = [_node(0), _node(1, spot=True), _node(2, spot=True)]
    spec = _spec(shards=2, min_workers=3, max_workers=16)
    assert wait_reason(nodes, spec, resolve("async")) == (
        "waiting for 5 nodes (2 for shards, on-demand preferred; 3 for workers); 3 free (1 on-demand, 2 spot); "
        "the cluster has 3 live nodes: 2 more must join")
    assert cluster_too_small(nodes, spec, resolve("async"))


def test_busy_and_lost_nodes_count_as_they_do_for_the_placer() -> None:
    nodes = [_node(0), _node(1, experiment_id="e"), _node(2, spot=True, experiment_id="e"), _node(3, spot=True),
             _node(4, state=pb.NODE_STATE_LOST), _node(5, spot=True)]
    spec = _spec(shards=1, min_workers=3)
    # 5 live nodes would do, but 2 are busy: it waits without the cluster being too small
    assert wait_reason(nodes, spec, resolve("sync")) == (
        "waiting for 4 nodes (1 for shards, on-demand preferred; 3 for workers); 3 free (1 on-demand, 2 spot), "
        "2 busy with other experiments")
    assert not cluster_too_small(nodes, spec, resolve("sync"))


def test_a_mode_without_servers_waits_for_workers_only() -> None:
    nodes = [_node(0, spot=True)]
    assert wait_reason(nodes, _spec(shards=2, min_workers=2), resolve("gossip")) == (
        "waiting for 2 nodes (2 for workers); 1 free (0 on-demand, 1 spot); the cluster has 1 live node: 1 more must join")


@pytest.mark.parametrize("mode", ["sync", "async", "gossip"])
@pytest.mark.parametrize("count", range(6))
def test_the_reason_is_empty_exactly_when_the_placer_places(mode: str, count: int) -> None:
    nodes = [_node(i, spot=i % 2 == 1) for i in range(count)]
    spec = _spec(shards=2, min_workers=2)
    placed = place_experiment(free_nodes(nodes), spec, resolve(mode)) is not None
    reason = wait_reason(nodes, spec, resolve(mode))
    assert (reason == "") == placed, (count, mode, reason)
    if not placed:
        need = 2 + (2 if mode != "gossip" else 0)
        assert reason.startswith(f"waiting for {need} nodes"), reason


# --- deadlines ---------------------------------------------------------------------------------
def test_an_experiment_left_without_nodes_says_it_waits_for_shard_hosts_and_a_worker() -> None:
    worker = RoleRec(node_id="w", role=WORKER, index=3)
    assert missing_shards([_shard("a", 1), worker], 3) == [0, 2]
    assert waiting_for([_shard("a", 0), _shard("a", 1), worker], 2) == ""
    assert waiting_for([_shard("a", 1), worker], 2) == "a node to host shard 0 (restored from the newest checkpoint)"
    assert waiting_for([], 2) == ("a node to host shards 0, 1 (restored from the newest checkpoint) and a node to "
                                  "run a worker")
    assert waiting_for([], 0) == "a node to run a worker"  # gossip: no shards to host


def test_a_wait_is_overdue_only_once_it_has_lasted_its_timeout_and_none_is_never_overdue() -> None:
    assert not overdue(0.0, now=1e9, timeout_s=1.0)
    assert not overdue(100.0, now=109.9, timeout_s=10.0)
    assert overdue(100.0, now=110.0, timeout_s=10.0)


def test_a_late_start_runs_without_unsynced_backups_or_fails_naming_the_shards_not_serving() -> None:
    synced = [_shard("a", 0, replicated=True), _shard("b", 0, 1)]
    unsynced = [_shard("a", 1), _shard("c", 1, 1, serving=False)]
    assert start_overdue(synced + unsynced, 2, since=100.0, now=150.0, timeout_s=60.0) is None
    late = start_overdue(synced + unsynced, 2, since=100.0, now=160.0, timeout_s=60.0)
    assert late == StartOverdue(backups=(unsynced[1],))  # shard 0's backup synced: it stays
    down = start_overdue([_shard("a", 0), _shard("b", 1, serving=False)], 3, since=100.0, now=200.0, timeout_s=60.0)
    assert down is not None and down.backups == ()
    assert down.reason == "did not start within 60 s (start_timeout_s): shards 1, 2 not serving"


def test_a_spec_stored_before_the_deadline_fields_existed_reads_their_defaults() -> None:
    from gossamer.coordinator.records import ExpRec
    from gossamer.core.experiment import Experiment

    old = ExpRec(id="e", seq=1, name="e", spec_json='{"mode": "async", "num_ps_shards": 2}')
    assert old.spec["num_ps_shards"] == 2
    assert old.spec["node_wait_timeout_s"] == Experiment.__dataclass_fields__["node_wait_timeout_s"].default


def test_a_shard_is_suspected_once_two_workers_time_out_on_it_within_the_window() -> None:
    from gossamer.coordinator.failover import ShardSuspicion

    s = ShardSuspicion(window_s=100.0)
    msg = "UnavailableError: shards [0, 2] did not answer within 60.0s"
    assert s.timed_out("e", "n1:0", msg, 0.0, workers=3) == []
    assert s.timed_out("e", "n1:0", msg, 1.0, workers=3) == []  # the same worker twice is one
    assert s.timed_out("f", "n2:1", msg, 2.0, workers=3) == []  # another experiment's worker
    assert s.timed_out("e", "n2:1", "ShardError: shard 0: bad push (INVALID_ARGUMENT)", 3.0, workers=3) == []
    assert s.timed_out("e", "n2:1", "UnavailableError: shards [2] did not answer within 60.0s", 4.0,
                       workers=3) == [2]
    assert s.timed_out("e", "n3:2", "UnavailableError: shards [0] did not answer", 200.0, workers=3) == []  # n1's expired
    alone = ShardSuspicion(window_s=100.0)  # a run of one worker: its timeout is every worker's
    assert alone.timed_out("e", "n1:0", "UnavailableError: shards [0] did not answer", 5.0, workers=1) == [0]


def test_shards_go_to_nodes_without_gpus_and_workers_to_nodes_with_them_when_both_exist() -> None:
    gpu_a, gpu_b = _node(1, gpus=8), _node(2, gpus=8)  # joined first: long-lived GPU nodes
    cpu = _node(3)  # a CPU shard host that joined after them
    spot_gpu = _node(4, spot=True, gpus=8)
    p = place([gpu_a, gpu_b, cpu, spot_gpu], num_servers=1, min_workers=2, max_workers=2)
    assert p is not None
    assert [n.id for n in p.servers] == ["n3"]  # on-demand, and no GPU left idle
    assert {n.id for n in p.workers} == {"n4", "n1"}  # GPU nodes train; spot before on-demand among them
    # Growing a run takes GPU nodes before a CPU host, and a shard's backup prefers the CPU host.
    assert [n.id for n in grow([cpu, gpu_b], current_workers=2, max_workers=3)] == ["n2"]
    host = replica_host(avoid={"n9"}, servers=[], free=[gpu_b, cpu], workers=[])
    assert host is not None and host.id == "n3"
    # Without GPUs anywhere the order is as before: on-demand, longest-lived first.
    plain = place([_node(5), _node(6), _node(7, spot=True)], num_servers=1, min_workers=2, max_workers=2)
    assert plain is not None and [n.id for n in plain.servers] == ["n5"]
