"""A malformed compressed push is refused with an ERROR reply and nothing is applied; good ones apply."""

from __future__ import annotations

import copy

import pytest
import torch
import zmq

from gossamer.compression import ChunkCompressor
from gossamer.examples.digits import mlp
from gossamer.paramserver import (
    OptimizerConfig,
    ShardConfig,
    ShardPlan,
    ShardServer,
    flatten_params,
)
from gossamer.transport.frames import Message, decode, encode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shard():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = mlp()
    plan = ShardPlan.for_module(model, 1)
    flat = flatten_params(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    srv = ShardServer(
        ShardConfig(experiment="e", shard=0, mode="async", staleness=None, total_steps=100,
                    optimizer=OptimizerConfig(name="sgd", lr=0.1)),
        plan, {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks}, shapes=shapes,
    )
    endpoint = srv.bind()
    srv.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    yield srv, plan, shapes, sock
    sock.close(linger=0)
    ctx.term()
    srv.close()


def _push(sock: zmq.Socket, tensors: dict, meta: dict) -> Message:  # type: ignore[type-arg]
    msg = Message(op="PUSH", experiment="e", shard=0, sender="w", meta={"clock": 0, "basis": 0, **meta},
                  tensors=tensors)
    sock.send_multipart(encode(msg))
    assert sock.poll(10_000), "no reply"
    return decode(sock.recv_multipart())


def _bad(tensors: dict, meta: dict, plan: ShardPlan, shapes: dict) -> list[tuple[str, dict, dict]]:  # type: ignore[type-arg]
    cases = []
    t = {k: v.clone() for k, v in tensors.items()}
    idx_name = next(k for k in t if k.endswith("/indices"))
    t[idx_name][-1] = plan.chunks[0].numel + 5  # out of range
    cases.append(("index out of range", t, meta))
    t = {k: v.clone() for k, v in tensors.items()}
    val_name = next(k for k in t if k.endswith("/values"))
    t[val_name] = t[val_name][:-3]  # truncated values
    cases.append(("truncated values", t, meta))
    m = copy.deepcopy(meta)
    m["compression"]["0"]["numel"] += 1
    cases.append(("meta numel mismatch", tensors, m))
    m = copy.deepcopy(meta)
    m["codec"] = "zip:9"
    cases.append(("unknown codec", tensors, m))
    m = copy.deepcopy(meta)
    m["compression"] = {"7": m["compression"]["0"]}
    cases.append(("chunk not on this shard", tensors, m))
    t = {k: v.clone() for k, v in tensors.items()}
    t[val_name] = torch.full_like(t[val_name], float("nan"))
    cases.append(("NaN values", t, meta))
    return cases


def test_malformed_compressed_pushes_are_refused_and_nothing_applied(shard) -> None:  # type: ignore[no-untyped-def]
    srv, plan, shapes, sock = shard
    enc = ChunkCompressor("topk:0.05", plan, shapes=shapes)
    wire, cmeta = enc.encode(0, torch.randn(plan.chunks[0].numel))
    meta = {"compression": {"0": cmeta}, "codec": "topk:0.05"}
    before = srv.values()
    for what, tensors, m in _bad(wire, meta, plan, shapes):
        reply = _push(sock, tensors, m)
        assert reply.op == "ERROR", what
        assert reply.meta["error"], what
        assert srv.version == 0, f"{what} was applied"
    assert all(torch.equal(before[i], v) for i, v in srv.values().items())
    reply = _push(sock, wire, meta)  # the intact push is accepted and applied once
    assert reply.op == "PARAMS" and srv.version == 1
