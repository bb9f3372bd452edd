"""Coordinators on one PostgreSQL state, in process: one leads, a deposed leader stops acting at once, the lock passes on."""

from __future__ import annotations

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

    # Both addresses, either order: the client reaches the leader.
    with Client(f"{b.address},{a.address}") as client:
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
