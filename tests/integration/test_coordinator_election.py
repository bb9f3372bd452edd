"""Coordinators on one PostgreSQL state, in process: one leads, a deposed leader stops acting at once, the lock passes on."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from gossamer import Client
from gossamer.coordinator.leader_gate import LEADER_KEY
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import MakeCluster, StartCoordinator
from tests.chaos._wait import wait_for

psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed: pip install 'gossamer[postgres]'")

pytestmark = pytest.mark.timeout(180)


def _list(address: str) -> grpc.RpcError | pb.ListExperimentsResponse:
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.ExperimentServiceStub(channel).List(pb.ListExperimentsRequest(), timeout=10)
        except grpc.RpcError as e:
            return e


def test_a_deposed_leader_refuses_everything_and_the_lock_passes_on(start_coordinator: StartCoordinator,
                                                                     postgres_url: str) -> None:
    a = start_coordinator(state=postgres_url)
    b = start_coordinator(state=postgres_url)
    assert a.server.leading and not b.server.leading
    assert isinstance(_list(a.address), pb.ListExperimentsResponse)
    refused = _list(b.address)
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert f"the leader is at {a.address}" in (refused.details() or "")

    # Both addresses, standby first, as a string or a list: the client reaches the leader.
    for both in (f"{b.address},{a.address}", [b.address, a.address]):
        with Client(both) as client:
            assert client.experiments() == []
            assert len(client.nodes()) == 0

    # The term moves on behind the leader's back: it stops acting within its next check.
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE gossamer_leader SET term = term + 1")
    wait_for(a.server.lost.is_set, 10, "the deposed leader to notice")
    assert not a.server.leading
    refused = _list(a.address)
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "not leader" in (refused.details() or "")
    assert (LEADER_KEY, "") in tuple(refused.trailing_metadata() or ())  # it no longer claims to know
    # Its session still holds the lock, so nobody else leads until it is gone (`serve` exits 3).
    assert not b.server.leading
    a.close()
    wait_for(lambda: b.server.leading, 10, "the standby to take the lock")
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT term, address FROM gossamer_leader").fetchone() == (3, b.address)
    assert isinstance(_list(b.address), pb.ListExperimentsResponse)


def test_coordinator_serve_exits_3_when_its_term_moves_on(make_cluster: MakeCluster, postgres_url: str) -> None:
    cluster = make_cluster()
    cluster.start_replicas(postgres_url, count=1)
    proc = cluster.replicas["c0"]
    with Client(cluster.address) as client:
        assert client.nodes() == []  # it leads
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE gossamer_leader SET term = term + 1")
    assert proc.wait(timeout=30) == 3  # a supervisor starts it again, as a standby
    assert "lost the lead" in (cluster.log_dir / "c0.log").read_text()


def test_secure_replicas_nodes_and_clients_follow_the_leader(tmp_path: Path, make_cluster: MakeCluster,
                                                             postgres_url: str) -> None:
    """mTLS and a token (`--secure DIR`) on two coordinators: one channel over both checks either
    certificate against the first address's host; a node and a client follow a kill -9 failover."""
    cluster = make_cluster(secure=tmp_path / "secure", coordinator_args=["--no-import-check"])
    cluster.start_replicas(postgres_url, count=2)
    cluster.add_node("n0")
    with cluster.client() as client:
        wait_for(lambda: [n["name"] for n in client.nodes()] == ["n0"], 60, "n0 to join over mTLS")
        with psycopg.connect(postgres_url) as conn:
            leader = conn.execute("SELECT address FROM gossamer_leader").fetchone()[0]
        name = next(n for n, p in cluster.replica_ports.items() if f"127.0.0.1:{p}" == leader)
        node_id = client.nodes()[0]["id"]
        # The leader stores the join before it answers: kill it only once the node has its answer,
        # else the node joins the next leader afresh under a new id.
        wait_for(lambda: f"as node {node_id}" in (cluster.log_dir / "n0.log").read_text(), 30, "n0's join answer")
        cluster.kill_coordinator(name)
        # The new leader knows the node from the shared state, and hears its heartbeats over mTLS.
        wait_for(lambda: [(n["id"], n["state"]) for n in client.nodes()] == [(node_id, "ready")], 30,
                 "the node at the new leader")
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute("SELECT term FROM gossamer_leader").fetchone()[0] == 2
        # It stays: a lease (5 s) later, still ready under the new leader, not lost.
        deadline = time.monotonic() + 7.0
        while time.monotonic() < deadline:
            assert [n["state"] for n in client.nodes()] == ["ready"]
            time.sleep(0.5)
