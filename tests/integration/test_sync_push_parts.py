"""A large dense sync push in parts: each added into the step's sum as it comes and acknowledged, the step exactly
the sum of whole pushes; a re-formed barrier, a dropped update or a part without its predecessors redoes the step
with nothing of the old sum kept (a real shard server, real ZMQ)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from gossamer.core.protocol import PushMeta, chunk_key
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.paramserver.push_parts import SYNC_PUSH_PART_BYTES, push_rounds
from gossamer.transport.frames import Message, decode, encode
from gossamer.transport.router import FAILED_PRECONDITION, REFORM

pytestmark = pytest.mark.timeout(120)

EXP = "parts"
LR = 0.5
#: Four chunks of 16 values; parts of two chunks (a budget of 130 bytes) in the raw-socket tests.
SMALL, SMALL_BUDGET = 64, 130


def _server(numel: int, chunk_numel: int) -> tuple[ShardPlan, ShardServer, str]:
    plan = ShardPlan.build([("w", numel)], 1, chunk_numel=chunk_numel)
    server = ShardServer(ShardConfig(experiment=EXP, shard=0, mode="sync", staleness=None,
                                     optimizer=OptimizerConfig(name="sgd", lr=LR, momentum=0.9), total_steps=100),
                         plan, {c.index: torch.zeros(c.numel) for c in plan.chunks})
    endpoint = server.bind()
    server.start()
    return plan, server, endpoint


@pytest.fixture
def small() -> Iterator[tuple[ShardPlan, ShardServer, str]]:
    plan, server, endpoint = _server(SMALL, 16)
    try:
        yield plan, server, endpoint
    finally:
        server.close()


class _Conn:
    """One worker connection speaking PUSH messages by hand (to send parts one by one)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, sender: str) -> None:
        self.sender = sender
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rid = 0

    def parts(self, plan: ShardPlan, value: float, *, step: int = 0, generation: int = 0) -> list[Message]:
        """The update (every chunk = `value`) in parts of two chunks, in order."""
        meta = PushMeta(clock=step, basis=step, step=step, num_workers=2, generation=generation).to_meta()
        whole = Message(op="PUSH", experiment=EXP, shard=0, sender=self.sender, meta=meta,
                        tensors={chunk_key(c.index): torch.full((c.numel,), value) for c in plan.chunks})
        rounds, _ = push_rounds({0: whole}, self._make, budget=SMALL_BUDGET)
        return [r[0] for r in rounds]

    def whole(self, plan: ShardPlan, value: float, *, num_workers: int) -> Message:
        """The update (every chunk = `value`) in one PUSH, as a push under `SYNC_PUSH_PART_BYTES` goes."""
        meta = PushMeta(clock=0, basis=0, step=0, num_workers=num_workers).to_meta()
        return self._make(0, meta, {chunk_key(c.index): torch.full((c.numel,), value) for c in plan.chunks})

    def _make(self, shard: int, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> Message:
        self.rid += 1
        return Message(op="PUSH", experiment=EXP, shard=shard, sender=self.sender, meta={**meta, "rid": self.rid},
                       tensors=tensors)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart([bytes(f) for f in encode(msg)])

    def recv(self, timeout_s: float = 20.0) -> Message:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply"
        return decode(self.sock.recv_multipart(copy=False))

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def conns(small: tuple[ShardPlan, ShardServer, str]) -> Iterator[list[_Conn]]:
    ctx = zmq.Context()
    out = [_Conn(ctx, small[2], f"w{i}") for i in range(2)]
    try:
        yield out
    finally:
        for c in out:
            c.close()
        ctx.term()


def _set_members(server: ShardServer, generation: int) -> None:
    """The coordinator's word, on the serve thread (as the role's pipe delivers it), once it has run."""
    ran = threading.Event()
    server.post(lambda: (server.set_members(["w0", "w1"], generation=generation), ran.set()))
    assert ran.wait(20), "the serve loop did not run the membership change"


def _values(server: ShardServer) -> torch.Tensor:
    return torch.cat([v for _, v in sorted(server.values().items())])


def _first_step(*grads: torch.Tensor) -> torch.Tensor:
    """The parameters after one SGD step from zeros on the sum of `grads` (added in this order)."""
    p = torch.zeros_like(grads[0], requires_grad=True)
    total = grads[0].clone()
    for g in grads[1:]:
        total.add_(g)
    p.grad = total
    torch.optim.SGD([p], lr=LR, momentum=0.9).step()
    return p.detach()


def test_a_large_sync_push_goes_in_parts_and_the_step_is_the_sum_of_both_workers_bit_for_bit() -> None:
    """Two workers' 32 MiB pushes: each goes in parts under 16 MiB (three messages and a pull of the values),
    and the step's parameters are those of one SGD step on the sum of the two gradients, bit for bit, in
    either order of arrival (two summands: IEEE addition is commutative)."""
    plan, server, endpoint = _server(8 << 20, 1 << 20)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(plan.total_numel, generator=g) for _ in range(2)]
    clients = [ShardClient(experiment=EXP, sender=f"w{i}", plan=plan, endpoints={0: endpoint}, timeout_s=60)
               for i in range(2)]
    results: dict[int, object] = {}
    try:
        def push(i: int) -> None:
            chunks = plan.gather(grads[i])
            results[i] = clients[i].push_pull(chunks, clock=0, basis={0: 0}, step=0, num_workers=2)

        threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(results) == [0, 1]
        parts = -(-4 * plan.total_numel // (SYNC_PUSH_PART_BYTES - 1))
        assert [c.messages for c in clients] == [parts + 1] * 2  # its parts, then the PULL of the values
        assert server.version == 1
        want = _first_step(grads[0], grads[1])
        assert torch.equal(_values(server), want)
        assert torch.equal(want, _first_step(grads[1], grads[0]))
        for res in results.values():
            got = torch.zeros(plan.total_numel)
            plan.scatter(got, res.values)  # type: ignore[attr-defined]
            assert torch.equal(got, want) and res.versions == {0: 1}  # type: ignore[attr-defined]
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_part_that_says_more_follow_is_acknowledged_once_in_the_sum_before_the_step(
        small: tuple[ShardPlan, ShardServer, str], conns: list[_Conn]) -> None:
    plan, server, _ = small
    a, b = conns
    a_parts, b_parts = a.parts(plan, 1.0), b.parts(plan, 2.0)
    a.send(a_parts[0])
    ack = a.recv()
    assert ack.op == "PARAMS" and ack.version == 0 and not ack.tensors, ack  # answered with the other worker silent
    a.send(a_parts[1])
    b.send(b_parts[0])
    assert b.recv().version == 0
    b.send(b_parts[1])
    assert a.recv().version == b.recv().version == 1  # the last parts: answered at the step
    assert torch.equal(_values(server), _first_step(torch.full((SMALL,), 1.0), torch.full((SMALL,), 2.0)))


def test_a_reform_between_parts_drops_the_partial_sum_and_the_redone_step_holds_none_of_it(
        small: tuple[ShardPlan, ShardServer, str], conns: list[_Conn]) -> None:
    plan, server, _ = small
    a, b = conns
    _set_members(server, 0)
    stale = a.parts(plan, 100.0)
    a.send(stale[0])
    assert a.recv().op == "PARAMS"  # in the step's sum
    b.send(b.parts(plan, 5.0)[0])
    assert b.recv().op == "PARAMS"
    _set_members(server, 1)  # the barrier re-forms: the step is redone
    a.send(stale[1])
    refused = a.recv()
    assert refused.op == "ERROR" and refused.meta["code"] == REFORM, refused
    for conn, value in ((a, 1.0), (b, 2.0)):
        for part in conn.parts(plan, value, generation=1):
            conn.send(part)
    for conn in (a, b):
        assert conn.recv().version == 0
    assert a.recv().version == b.recv().version == 1
    assert torch.equal(_values(server), _first_step(torch.full((SMALL,), 1.0), torch.full((SMALL,), 2.0)))
    assert server.discarded["reform"] == 3  # the two updates dropped, and the stale part refused


def test_an_update_dropped_after_its_parts_were_summed_redoes_the_step_for_every_worker(
        small: tuple[ShardPlan, ShardServer, str], conns: list[_Conn]) -> None:
    """A's first part is in the step's sum when its second is refused (not finite): the sum cannot give A's part
    back, so B's whole contribution is refused too (FAILED_PRECONDITION: pull and redo), and a part of the dropped
    update sent after it is refused as having lost its predecessors. The redone step holds only the new pushes."""
    plan, server, _ = small
    a, b = conns
    for part in b.parts(plan, 2.0):
        b.send(part)
    assert b.recv().op == "PARAMS"  # B's first part acknowledged; its last waits for the step
    a_parts = a.parts(plan, 100.0)
    a.send(a_parts[0])
    assert a.recv().op == "PARAMS"
    bad = a_parts[1]
    bad.tensors = {k: torch.full_like(t, float("nan")) for k, t in bad.tensors.items()}
    a.send(bad)
    assert a.recv().op == "ERROR"
    voided = b.recv()
    assert voided.op == "ERROR" and voided.meta["code"] == FAILED_PRECONDITION, voided
    assert "redo" in voided.meta["error"]
    a.send(a.parts(plan, 100.0)[1])  # the rest of the dropped update: its first part is gone
    late = a.recv()
    assert late.op == "ERROR" and late.meta["code"] == FAILED_PRECONDITION and "dropped" in late.meta["error"], late
    assert server.version == 0 and server.discarded["voided"] == 1
    for conn, value in ((a, 1.0), (b, 2.0)):
        for part in conn.parts(plan, value):
            conn.send(part)
    for conn in (a, b):
        assert conn.recv().version == 0
    assert a.recv().version == b.recv().version == 1
    assert torch.equal(_values(server), _first_step(torch.full((SMALL,), 1.0), torch.full((SMALL,), 2.0)))


def test_small_sync_pushes_are_added_at_the_step_in_sender_order_whatever_order_they_arrive_in(
        small: tuple[ShardPlan, ShardServer, str]) -> None:
    """Three workers' whole pushes (under 16 MiB: held, not summed on arrival) arrive w1, w2, w0. Summed in that
    order 2^-24 + 2^-24 + 1 is 1 + 2^-23; in sender order (1 + 2^-24) + 2^-24 rounds to 1 twice: the step must
    take the sender order's bits, the same every run (ReLU training turns a last bit into a 1e-3 difference)."""
    plan, server, endpoint = small
    ctx = zmq.Context()
    conns = [_Conn(ctx, endpoint, f"w{i}") for i in range(3)]
    try:
        tiny = 2.0**-24
        for i in (1, 2, 0):
            conns[i].send(conns[i].whole(plan, 1.0 if i == 0 else tiny, num_workers=3))
            time.sleep(0.2)  # read in this order (three connections are fair-queued)
        assert [c.recv().version for c in conns] == [1, 1, 1]
        want = _first_step(*(torch.full((SMALL,), v) for v in (1.0, tiny, tiny)))
        assert not torch.equal(want, _first_step(*(torch.full((SMALL,), v) for v in (tiny, tiny, 1.0))))
        assert torch.equal(_values(server), want)
    finally:
        for c in conns:
            c.close()
        ctx.term()
