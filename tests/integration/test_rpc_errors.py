"""Every coordinator RPC, unary or streaming, ends an unexpected error with a status (INTERNAL and its message), and serves on."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
import pytest

from gossamer.core.errors import NotFoundError
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


def _boom(*args: Any, **kw: Any) -> NoReturn:
    raise RuntimeError("boom in the handler")


def _join(nodes: pb_grpc.NodeServiceStub) -> str:
    return nodes.Join(pb.JoinRequest(name="n", address="127.0.0.1", hostname="h"), timeout=10).node_id


def test_an_unexpected_error_in_a_unary_handler_is_internal_with_its_message_and_the_server_serves_on(
        coordinator, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(coordinator.address) as ch:
        nodes = pb_grpc.NodeServiceStub(ch)
        node_id = _join(nodes)
        monkeypatch.setattr(coordinator.server.coord, "heartbeat", _boom)  # a handler that had no guard
        with pytest.raises(grpc.RpcError) as err:
            nodes.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=10)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert err.value.details() == "RuntimeError: boom in the handler"
        monkeypatch.undo()
        assert nodes.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=10).known
        assert [n.id for n in nodes.ListNodes(pb.ListNodesRequest(), timeout=10).nodes] == [node_id]


def test_an_unexpected_error_in_a_streaming_handler_ends_the_stream_with_internal(coordinator, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(coordinator.address) as ch:
        nodes = pb_grpc.NodeServiceStub(ch)
        node_id = _join(nodes)
        monkeypatch.setattr(coordinator.server.coord, "assignments_for", _boom)
        stream = nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=node_id), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "boom in the handler" in err.value.details()
        monkeypatch.undo()
        assert next(nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=node_id), timeout=10)).serial > 0


def test_a_gossamer_error_in_any_handler_gets_its_own_code(coordinator, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    async def missing(*args: Any, **kw: Any) -> NoReturn:
        raise NotFoundError("no such thing")

    monkeypatch.setattr(coordinator.server.coord.store, "events", missing)
    with grpc.insecure_channel(coordinator.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ExperimentServiceStub(ch).ListEvents(pb.ListEventsRequest(), timeout=10)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.NOT_FOUND, "no such thing")
