"""Push credits through a real shard and real ZMQ sockets: a large push is sent only once the shard grants it,
one dense push of the shard at a time, and a credit held by a connection that never pushes is taken back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from gossamer.core.errors import UnavailableError
from gossamer.core.protocol import CreditMeta, chunk_key
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.paramserver.push_credits import CREDIT_MIN_BYTES
from gossamer.transport.frames import FrameLimits, Message, decode, encode

pytestmark = pytest.mark.timeout(120)
NUMEL = CREDIT_MIN_BYTES // 4  # one dense push of the shard is exactly the smallest that asks
EXPERIMENT = "credits"


@pytest.fixture
def shard() -> Iterator[ShardServer]:
    plan = ShardPlan.build([("w", NUMEL)], 1)
    config = ShardConfig(experiment=EXPERIMENT, shard=0, mode="async", staleness=None,
                         optimizer=OptimizerConfig(name="sgd", lr=0.01), total_steps=10**6)
    server = ShardServer(config, plan, {c.index: torch.zeros(c.numel) for c in plan.chunks}, shapes={"w": (NUMEL,)})
    server.start()
    try:
        yield server
    finally:
        server.close()


def _wait_for(what: str, cond: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class _RawWorker:
    """A worker speaking the wire protocol on its own DEALER, to hold a grant as long as the test likes."""

    def __init__(self, ctx: zmq.Context, endpoint: str, sender: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sender = sender

    def send(self, op: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.sock.send_multipart(encode(Message(op=op, experiment=EXPERIMENT, shard=0, sender=self.sender,
                                                meta=meta, tensors=tensors or {})))

    def recv(self, timeout_s: float = 60.0) -> Message:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply"
        return decode(self.sock.recv_multipart(), FrameLimits.for_values(NUMEL))


def test_a_second_large_push_waits_for_the_shard_to_read_the_first(shard: ShardServer) -> None:
    plan = shard.plan
    ctx = zmq.Context()
    raw = _RawWorker(ctx, shard.endpoint, "holder")
    client = ShardClient(experiment=EXPERIMENT, sender="w1", plan=plan, endpoints={0: shard.endpoint}, timeout_s=60)
    try:
        raw.send("CREDIT", {"rid": 1, **CreditMeta(nbytes=4 * NUMEL).to_meta()})
        grant = raw.recv()
        assert (grant.op, grant.meta["rid"]) == ("GRANT", 1)

        result: dict[str, Any] = {}
        grads = {c.index: torch.ones(c.numel) for c in plan.chunks}
        worker = threading.Thread(target=lambda: result.update(r=client.push_pull(grads, clock=0, basis={0: 0})))
        worker.start()
        # The client's CREDIT is queued behind the held grant, and its push is not sent meanwhile.
        _wait_for("the client's credit request to wait", lambda: shard.stats()["credit_waiting"] == 1)
        assert worker.is_alive() and shard.version == 0 and shard.stats()["bytes_in"] < 4096

        raw.send("PUSH", {"rid": 1, "clock": 0, "basis": 0}, {chunk_key(c.index): torch.full((c.numel,), 2.0) for c in plan.chunks})
        reply = raw.recv()
        assert reply.op == "PARAMS", reply.meta
        worker.join(timeout=60)
        # Applied after the holder's push, which the shard read only after the client had asked.
        assert not worker.is_alive() and result["r"].versions == {0: 2}
        stats = shard.stats()
        assert stats["credit_waited"] == 1 and stats["credit_peak_bytes"] == 4 * NUMEL, stats
        assert client.credits.asked == 1
        # Small requests never ask: a pull, and a push under the threshold (a codec's payload is smaller).
        client.pull()
        assert client.credits.asked == 1
    finally:
        client.close()
        raw.sock.close()
        ctx.term()


def test_a_grant_whose_worker_is_no_longer_named_is_taken_back(shard: ShardServer) -> None:
    plan = shard.plan
    ctx = zmq.Context()
    raw = _RawWorker(ctx, shard.endpoint, "leaver")
    client = ShardClient(experiment=EXPERIMENT, sender="w1", plan=plan, endpoints={0: shard.endpoint}, timeout_s=60)
    try:
        raw.send("CREDIT", {"rid": 4, **CreditMeta(nbytes=4 * NUMEL).to_meta()})
        assert raw.recv().op == "GRANT"
        result: dict[str, Any] = {}
        grads = {c.index: torch.ones(c.numel) for c in plan.chunks}
        worker = threading.Thread(target=lambda: result.update(r=client.push_pull(grads, clock=0, basis={0: 0})))
        worker.start()
        _wait_for("the client's credit request to wait", lambda: shard.stats()["credit_waiting"] == 1)
        assert worker.is_alive()
        # The coordinator names the workers without the holder (it was replaced): its grant goes at the next tick.
        shard.set_members(["w1"])
        worker.join(timeout=60)
        assert not worker.is_alive() and result["r"].versions == {0: 1}
        # A sender the coordinator did not name gets no credit at all.
        raw.send("CREDIT", {"rid": 5, **CreditMeta(nbytes=4 * NUMEL).to_meta()})
        refused = raw.recv()
        assert refused.op == "ERROR" and "not a current worker" in refused.meta["error"], refused.meta
        assert shard.stats()["credit_waiting"] == 0
    finally:
        client.close()
        raw.sock.close()
        ctx.term()


def test_bad_credit_requests_are_refused_and_the_shard_keeps_serving(shard: ShardServer) -> None:
    ctx = zmq.Context()
    raw = _RawWorker(ctx, shard.endpoint, "odd")
    try:
        for meta, says in (({"rid": 1}, "nbytes"), ({"rid": 2, "nbytes": -3}, "nbytes"),
                           ({"rid": 3, "nbytes": 1 << 40}, "message limit")):
            raw.send("CREDIT", meta)
            reply = raw.recv()
            assert reply.op == "ERROR" and says in reply.meta["error"], reply.meta
        raw.send("CREDIT", {"rid": 6, "nbytes": 8}, {"x": torch.zeros(2)})
        assert "carries no tensors" in raw.recv().meta["error"]
        for rid in range(10, 60):  # asked again and again: one request, granted again each time
            raw.send("CREDIT", {"rid": rid, "nbytes": 8})
            assert raw.recv().meta["rid"] == rid
        assert shard.stats()["credit_waiting"] == 0 and shard.stats()["credit_peak_bytes"] == 8
    finally:
        raw.sock.close()
        ctx.term()
    with ShardClient(experiment=EXPERIMENT, sender="w1", plan=shard.plan, endpoints={0: shard.endpoint},
                     timeout_s=60) as client:
        assert client.pull().versions == {0: 0}


def test_a_client_refused_a_credit_says_why_and_never_sends_the_push(shard: ShardServer) -> None:
    """As for a push from a worker the coordinator has not named yet: asked again until the timeout, which
    gives the shard's reason; the 16 MiB push itself never crosses the link."""
    shard.set_members(["someone-else"])
    with ShardClient(experiment=EXPERIMENT, sender="w1", plan=shard.plan, endpoints={0: shard.endpoint},
                     timeout_s=3) as client:
        with pytest.raises(UnavailableError, match="not a current worker"):
            client.push_pull({c.index: torch.ones(c.numel) for c in shard.plan.chunks}, clock=0, basis={0: 0})
        assert client.credits.asked >= 1 and shard.stats()["bytes_in"] < 4096 * client.credits.asked


def test_an_overlapped_push_is_granted_and_sent_before_push_async_returns(shard: ShardServer) -> None:
    """With `overlap`, push_async waits for the grant (one round trip) and sends: the push is applied while
    the worker computes, before it calls wait()."""
    with ShardClient(experiment=EXPERIMENT, sender="w1", plan=shard.plan, endpoints={0: shard.endpoint},
                     timeout_s=60) as client:
        client.push_async({c.index: torch.ones(c.numel) for c in shard.plan.chunks}, clock=0, basis={0: 0})
        assert client.credits.asked == 1 and client.in_flight
        _wait_for("the overlapped push to be applied", lambda: shard.version == 1)
        assert client.wait().versions == {0: 1}
