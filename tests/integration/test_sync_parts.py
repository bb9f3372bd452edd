"""A SYNC in parts (`SYNC_PART_BYTES`): cut into whole chunks, loaded part by part, refused out of sequence."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from gossamer.paramserver import OptimizerConfig, ShardConfig, ShardPlan, ShardServer
from gossamer.paramserver._replication import sync_parts
from gossamer.security.sender_tokens import new_key, primary_sender, token_for
from gossamer.transport.frames import FrameLimits, Message, decode, encode
from gossamer.transport.router import OUT_OF_ORDER, UNAUTHENTICATED

pytestmark = pytest.mark.timeout(120)


def test_parts_are_whole_chunks_in_order_within_the_budget() -> None:
    rng = random.Random(5)
    for _ in range(200):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]
        tensors: dict[str, torch.Tensor] = {}
        for idx, n in enumerate(sizes):
            tensors[f"c{idx}"] = torch.zeros(n)
            for name in rng.sample(["momentum_buffer", "exp_avg", "exp_avg_sq"], rng.randint(0, 2)):
                tensors[f"c{idx}/{name}"] = torch.zeros(n)
        budget = rng.randint(4, 400)
        parts = sync_parts(tensors, budget)
        assert parts and all(parts)
        seen = [name for part in parts for name in part]
        assert sorted(seen) == sorted(tensors)  # every tensor once
        chunks = [[int(name.partition("/")[0][1:]) for name in part] for part in parts]
        flat = [i for part in chunks for i in dict.fromkeys(part)]
        assert flat == sorted(flat) and len(flat) == len(set(flat))  # whole chunks, in chunk order
        for part in parts:
            nbytes = sum(4 * t.numel() for t in part.values())
            assert nbytes <= budget or len({n.partition("/")[0] for n in part}) == 1, (nbytes, budget)


@pytest.fixture
def backup() -> Iterator[tuple[ShardServer, str, bytes]]:
    """A backup shard of 4 chunks of 1000 values, SGD with momentum, checking senders with `key`."""
    plan = ShardPlan.build([("w", 4000)], 1, chunk_numel=1000)
    config = ShardConfig(experiment="parts", shard=0, mode="async", staleness=None, total_steps=100,
                         optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
    key = new_key()
    server = ShardServer(config, plan, {c.index: torch.zeros(c.numel) for c in plan.chunks}, backup=True)
    server.set_sender_key(key)
    endpoint = server.bind()
    server.start()
    try:
        yield server, endpoint, key
    finally:
        server.close()


def _part(key: bytes, version: int, part: int, parts: int, chunks: list[int], *, sender: str = "",
          value: float = 1.0) -> Message:
    sender = sender or primary_sender(0)
    tensors: dict[str, torch.Tensor] = {}
    for idx in chunks:
        tensors[f"c{idx}"] = torch.full((1000,), value + idx)
        tensors[f"c{idx}/momentum_buffer"] = torch.full((1000,), -value - idx)
    meta: dict[str, Any] = {"rid": 1, "auth": token_for(key, sender), "epoch": 0, "state_version": version,
                            "applied": {"w:0": version}, "scalars": {}, "part": part, "parts": parts}
    return Message(op="SYNC", experiment="parts", shard=0, version=version, sender=sender, meta=meta,
                   tensors=tensors)


def _send(sock: zmq.Socket, msg: Message) -> Message | None:
    sock.send_multipart(encode(msg))
    return decode(sock.recv_multipart(), FrameLimits()) if sock.poll(3000) else None


def test_a_backup_loads_a_sync_part_by_part_and_refuses_parts_out_of_sequence(
        backup: tuple[ShardServer, str, bytes]) -> None:
    server, endpoint, key = backup
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        # A part that continues no SYNC, and one from a sender that is not the primary, are refused.
        reply = _send(sock, _part(key, 7, 1, 2, [2, 3]))
        assert reply is not None and reply.op == "ERROR" and reply.meta["code"] == OUT_OF_ORDER, reply
        reply = _send(sock, _part(key, 7, 0, 2, [0, 1], sender="w:0"))
        assert reply is not None and reply.meta.get("code") == UNAUTHENTICATED, reply
        # Part 0 of 2 is loaded without an answer, and the backup is not at the SYNC's version yet.
        assert _send(sock, _part(key, 7, 0, 2, [0, 1])) is None
        assert server.version == 0
        # Another SYNC's part 0 abandons the first; a part of the first one no longer fits.
        assert _send(sock, _part(key, 9, 0, 2, [0, 1], value=10.0)) is None
        reply = _send(sock, _part(key, 7, 1, 2, [2, 3]))
        assert reply is not None and reply.meta.get("code") == OUT_OF_ORDER, reply
        # The abandoned SYNC cannot be finished, and the refused part broke the new one off too: start again.
        assert _send(sock, _part(key, 9, 0, 2, [0, 1], value=10.0)) is None
        reply = _send(sock, _part(key, 9, 1, 2, [2, 3], value=10.0))
        assert reply is not None and reply.op == "ACK" and reply.meta.get("synced") is True, reply
        assert server.version == 9
        state = server.state_dict()
        for idx in range(4):
            assert torch.equal(state["values"][idx], torch.full((1000,), 10.0 + idx))
            assert torch.equal(state["optimizer"]["state"][idx]["momentum_buffer"], torch.full((1000,), -10.0 - idx))
        assert server.stats()["sync_parts_in"] == 4
        synced = {idx: t.clone() for idx, t in state["values"].items()}
        # A SYNC whose parts leave a chunk out, or bring one twice, is refused at that part (the version stays).
        assert _send(sock, _part(key, 10, 0, 2, [0, 1])) is None
        reply = _send(sock, _part(key, 10, 1, 2, [2]))
        assert reply is not None and reply.op == "ERROR" and "3 of this shard's 4" in str(reply.meta), reply
        assert _send(sock, _part(key, 10, 0, 2, [0, 1])) is None
        reply = _send(sock, _part(key, 10, 1, 2, [1, 2, 3]))
        assert reply is not None and reply.op == "ERROR" and "earlier part" in str(reply.meta), reply
        assert server.version == 9
        # A part carrying a chunk this shard does not have is refused, and the backup keeps serving.
        bad = _part(key, 11, 0, 1, [0, 1, 2, 3])
        bad.tensors["c9"] = torch.zeros(1000)
        reply = _send(sock, bad)
        assert reply is not None and reply.op == "ERROR" and "c9" in str(reply.meta.get("error")), reply
        assert server.version == 9
        # The refused SYNCs' parts 0 were loaded into place (a SYNC mixes versions until its last part): the
        # values now are those parts' for chunks 0 and 1, version 9's for 2 and 3.
        now = server.state_dict()["values"]
        assert torch.equal(now[0], torch.full((1000,), 1.0)) and torch.equal(now[3], synced[3])
    finally:
        sock.close()
        ctx.term()
