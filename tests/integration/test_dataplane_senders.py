"""Who may speak as a data-plane sender: with CURVE only the sender's own
node key, whatever token it carries; and a shard gathers PUSH parts only from current workers,
at most two half-gathered updates each. Real sockets, real CURVE keys, servers in this process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.paramserver._updates import GATHERING_PER_SENDER
from gossamer.security.curve import CurveKeyPair, CurveKeyring
from gossamer.security.sender_tokens import new_key, primary_sender, token_for
from gossamer.training.gossip import PushSumPeer
from gossamer.transport.frames import FrameLimits, Message, decode, encode
from gossamer.transport.router import ABORTED, NOT_A_WORKER, UNAUTHENTICATED

pytestmark = pytest.mark.timeout(120)

EXP = "senders"


def _config(**over: Any) -> ShardConfig:
    return ShardConfig(experiment=EXP, shard=0, mode="async", staleness=None,
                       optimizer=OptimizerConfig(name="sgd", lr=0.5), total_steps=10_000, expect_backup=False, **over)


class _Node:
    """A node's key pair and the keyring its role process holds."""

    def __init__(self) -> None:
        self.keys = CurveKeyPair.generate()
        self.keyring = CurveKeyring(self.keys)

    @property
    def public(self) -> str:
        return self.keys.public


class _Dealer:
    """A raw ZMQ DEALER (no gossamer client), over CURVE as `node` when given."""

    def __init__(self, endpoint: str, node: _Node | None = None, server_key: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if node is not None:
            assert server_key is not None
            node.keyring.update(server_keys={endpoint: server_key})
            node.keyring.secure_client(self.sock, endpoint)
        self.sock.connect(endpoint)

    def ask(self, msg: Message, timeout_s: float = 20.0) -> Message:
        self.sock.send_multipart(encode(msg))
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply to {msg.op} ({msg.sender!r})"
        return decode(self.sock.recv_multipart(), FrameLimits())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _code(reply: Message) -> str | None:
    return reply.meta.get("code") if reply.op in ("ERROR", "NACK") else None


@pytest.fixture
def plan() -> ShardPlan:
    return ShardPlan.build([("w", 40), ("b", 8)], 1, chunk_numel=16)  # 3 chunks: an update may come in parts


def _grads(plan: ShardPlan, chunks: list[int] | None = None) -> dict[str, torch.Tensor]:
    return {f"c{c.index}": torch.full((c.numel,), 0.01) for c in plan.chunks if chunks is None or c.index in chunks}


@pytest.fixture
def nodes() -> Iterator[dict[str, _Node]]:
    yield {name: _Node() for name in ("shard", "backup", "A", "B")}


def test_with_curve_a_member_holding_a_valid_token_for_another_sender_is_refused_by_shards_and_gossip_peers(
    plan: ShardPlan, nodes: dict[str, _Node],
) -> None:
    """Any shard host can mint every sender's token (it holds the experiment key): with CURVE the
    sender must also be the connection's own node, as the coordinator bound it (`curve_senders`)."""
    key = new_key()
    a_id, b_id = "A:0", "B:1"
    senders = {a_id: nodes["A"].public, b_id: nodes["B"].public, primary_sender(0): nodes["shard"].public}
    members = [n.public for n in nodes.values()]
    for n in nodes.values():
        n.keyring.update(members=members, senders=senders)
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    primary = ShardServer(_config(), plan, init, curve=nodes["shard"].keyring)
    backup = ShardServer(_config(), plan, init, curve=nodes["backup"].keyring, backup=True)
    for srv in (primary, backup):
        srv.set_sender_key(key)
        srv.set_members([a_id, b_id])
        srv.start()
    assert primary.endpoint is not None and backup.endpoint is not None
    peer = PushSumPeer(experiment=EXP, peer_id="0", numel=8, curve=nodes["A"].keyring)
    nodes["A"].keyring.update(senders={"0": nodes["A"].public, "1": nodes["B"].public})  # gossip: worker indices
    as_a = _Dealer(primary.endpoint, nodes["A"], nodes["shard"].public)
    to_backup = _Dealer(backup.endpoint, nodes["A"], nodes["backup"].public)
    to_peer = _Dealer(peer.endpoint, nodes["B"], nodes["A"].public)
    nodes["B"].keyring.update(server_keys={primary.endpoint: nodes["shard"].public})
    b = ShardClient(experiment=EXP, sender=b_id, token=token_for(key, b_id), plan=plan,
                    endpoints={0: primary.endpoint}, timeout_s=20, curve=nodes["B"].keyring)
    try:
        b.hello(fresh=True)
        b.push_pull({c.index: torch.full((c.numel,), 0.01) for c in plan.chunks}, clock=0, basis={0: 0})

        def forged(op: str, sender: str, meta: dict[str, Any], **kw: Any) -> Message:
            return Message(op=op, experiment=EXP, shard=0, sender=sender,
                           meta={"rid": 7, "auth": token_for(key, sender), **meta}, **kw)

        # Node A speaks for B over its own connection, with B's valid token: a PUSH with a higher
        # clock (B's updates would then count as duplicates) and a LEAVE (discarding B's pending one).
        push = forged("PUSH", b_id, {"clock": 1000, "basis": 0}, tensors=_grads(plan))
        reply = as_a.ask(push)
        assert _code(reply) == UNAUTHENTICATED and "CURVE key" in reply.meta["error"], reply.meta
        assert _code(as_a.ask(forged("LEAVE", b_id, {}))) == UNAUTHENTICATED
        # ... and for a sender the coordinator never named (a valid token minted for it).
        assert _code(as_a.ask(forged("HELLO", "A:9", {}))) == UNAUTHENTICATED
        # The primary's replication id, with its valid token, from a node that is not the primary.
        sync = forged("SYNC", primary_sender(0), {"epoch": 0})
        assert _code(to_backup.ask(sync)) == UNAUTHENTICATED
        assert backup.stats()["version"] == 0
        # A gossip peer: node B sends a snapshot request and a CANCEL as peer "0" (node A's index).
        snap = Message(op="SNAP", experiment=EXP, sender="0", meta={"rid": 3, "light": True})
        reply = to_peer.ask(snap)
        assert _code(reply) == UNAUTHENTICATED and reply.meta["reason"] == "unauthenticated", reply.meta
        cancel = Message(op="CANCEL", experiment=EXP, sender="0", meta={"id": 5, "inc": 1})
        assert _code(to_peer.ask(cancel)) == UNAUTHENTICATED
        # A's own sender still works over its connection; B's next update applies (clock 1, not a duplicate).
        assert as_a.ask(forged("HELLO", a_id, {"fresh": True})).op == "WELCOME"
        b.push_pull({c.index: torch.full((c.numel,), 0.01) for c in plan.chunks}, clock=1, basis={0: 0})
        st = primary.stats()
    finally:
        for d in (as_a, to_backup, to_peer):
            d.close()
        b.close()
        peer.close()
        primary.close()
        backup.close()
    assert st["version"] == 2 and st["applied"][b_id] == 1, st
    assert st["discarded"].get("duplicate", 0) == 0 and st["discarded"]["unauthenticated"] == 1, st["discarded"]


def test_push_parts_from_a_non_worker_are_refused_before_gathering_and_a_worker_holds_at_most_two_half_gathered(
    plan: ShardPlan,
) -> None:
    """Parts of an update wait for the others; before, any sender id's parts waited until it
    expired (`worker_timeout_s`), one per clock, so invented senders and clocks cost unbounded memory."""
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    srv = ShardServer(_config(), plan, init)
    srv.set_members(["w0"])  # the coordinator's workers
    srv.start()
    assert srv.endpoint is not None
    raw = _Dealer(srv.endpoint)
    w0 = ShardClient(experiment=EXP, sender="w0", plan=plan, endpoints={0: srv.endpoint}, timeout_s=20)
    try:
        w0.hello(fresh=True)
        # 20 invented senders, one part each of an update: each refused at once, nothing gathered.
        for i in range(20):
            part = Message(op="PUSH", experiment=EXP, shard=0, sender=f"ghost-{i}",
                           meta={"rid": i, "clock": 0, "basis": 0}, tensors=_grads(plan, [0]))
            reply = raw.ask(part)
            assert _code(reply) == NOT_A_WORKER and "not a current worker" in reply.meta["error"], reply.meta
        assert srv.stats()["gathering"] == 0
        # The worker starts 6 updates without finishing one: only its newest two stay gathered.
        aborted = 0
        for clock in range(6):
            part = Message(op="PUSH", experiment=EXP, shard=0, sender="w0",
                           meta={"rid": 100 + clock, "clock": clock, "basis": 0}, tensors=_grads(plan, [0]))
            raw.sock.send_multipart(encode(part))
            while raw.sock.poll(200):  # the parts an abort answers
                msg = decode(raw.sock.recv_multipart(), FrameLimits())
                assert _code(msg) == ABORTED, msg.meta
                aborted += 1
        st = srv.stats()
        assert st["gathering"] == GATHERING_PER_SENDER == 2, st["gathering"]
        # The newest update completes with its other parts and applies.
        res = w0.push_pull({c.index: torch.full((c.numel,), 0.01) for c in plan.chunks if c.index != 0},
                           clock=5, basis={0: 0})
        assert res.versions == {0: 1}
        answered = False  # the raw part of clock 5 is answered with the update's values
        while (aborted < 4 or not answered) and raw.sock.poll(5000):
            msg = decode(raw.sock.recv_multipart(), FrameLimits())
            if msg.op == "PARAMS" and msg.meta["rid"] == 105:
                answered = True
                continue
            assert _code(msg) == ABORTED, msg.meta
            aborted += 1
        st = srv.stats()
    finally:
        raw.close()
        w0.close()
        srv.close()
    assert answered and aborted == 4 and st["discarded"]["aborted"] == 4, (answered, aborted, st["discarded"])
    assert st["discarded"]["not_member"] == 20 and st["gathering"] == 1 and st["applied"] == {"w0": 5}, st
