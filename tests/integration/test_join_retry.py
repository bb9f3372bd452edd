"""A Join whose answer is lost on the way back: the node's retry re-attaches, no second node record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)


class _LosingProxy(grpc.GenericRpcHandler):
    """Forwards every call to `target` as raw bytes; the first Join is served there, but its
    answer never reaches the caller (UNAVAILABLE instead), as on a connection cut at that moment."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.lost: list[bytes] = []  # the answers not delivered

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.endswith("/WatchAssignments"):
            return grpc.unary_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _unary(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            answer: bytes = self.channel.unary_unary(method)(request, timeout=30)
            if method.endswith("/Join") and not self.lost:
                self.lost.append(answer)
                context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost on the way back")
            return answer
        return call

    def _stream(self, method: str) -> Callable[[bytes, grpc.ServicerContext], Iterator[bytes]]:
        def call(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            upstream = self.channel.unary_stream(method)(request)
            context.add_callback(upstream.cancel)
            yield from upstream
        return call


def test_a_join_retried_after_its_answer_was_lost_makes_one_node(start_coordinator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A lease that outlives the retry, so the retry meets the first record alive (the fixture's 1 s
    # lapsed at load 17 after the agent had joined, and a LOST record is replaced, not re-attached).
    coordinator = start_coordinator(heartbeat_interval_s=0.5, lease_timeout_s=15.0)
    proxy = _LosingProxy(coordinator.address)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[proxy])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen([sys.executable, "-m", "gossamer.tools.cli", "worker", "join", f"127.0.0.1:{port}",
                                  "--name", "retry"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    nodes = pb_grpc.NodeServiceStub(grpc.insecure_channel(coordinator.address))
    try:
        deadline = time.monotonic() + 90
        while "joined" not in log.read_text() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "joined" in log.read_text(), log.read_text()
        assert len(proxy.lost) == 1  # the first answer never arrived, so the node joined again
        first = pb.JoinResponse.FromString(proxy.lost[0]).node_id
        listed = {n.id: n.state for n in nodes.ListNodes(pb.ListNodesRequest(), timeout=10).nodes}
        assert listed == {first: pb.NODE_STATE_READY}, listed  # one record: the retry re-attached to it
        assert f"as node {first}" in log.read_text()
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        server.stop(0)
        proxy.channel.close()


@pytest.mark.parametrize("node_id", ["../../etc", "x" * 65, "a b", "-lead"])
def test_a_proposed_node_id_out_of_its_grammar_is_refused_naming_the_field(coordinator, node_id: str) -> None:  # type: ignore[no-untyped-def]
    nodes = pb_grpc.NodeServiceStub(grpc.insecure_channel(coordinator.address))
    with pytest.raises(grpc.RpcError) as e:
        nodes.Join(pb.JoinRequest(name="n", address="127.0.0.1", node_id=node_id), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "node_id" in (e.value.details() or "")
    assert list(nodes.ListNodes(pb.ListNodesRequest(), timeout=10).nodes) == []

