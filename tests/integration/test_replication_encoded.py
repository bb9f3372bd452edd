"""Replication of compressed pushes: the primary forwards them encoded, its backup decodes and applies them
as the primary did and holds bit-identical state (real shard servers on real ZMQ sockets, in process)."""

from __future__ import annotations

import copy
import re
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import zmq

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.protocol import Authority, PushCompression, ReplicateMeta
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.security.sender_tokens import new_key, primary_sender, token_for
from gossamer.transport.frames import FrameLimits, Message, decode, encode
from gossamer.transport.router import INVALID_ARGUMENT, UNAUTHENTICATED

pytestmark = pytest.mark.timeout(180)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _setup() -> tuple[ShardPlan, dict[str, tuple[int, ...]], dict[int, torch.Tensor]]:
    m = _model()
    plan = ShardPlan.for_module(m, 1, chunk_numel=1024)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks}
    return plan, {n: tuple(p.shape) for n, p in m.named_parameters()}, init


def _config(mode: str) -> ShardConfig:
    # A server optimizer with state (Nesterov momentum, weight decay), a schedule and per-update lr
    # factors (staleness in async, linear scaling in sync): all of it must replay the same.
    return ShardConfig(experiment="enc", shard=0, mode=mode, staleness=None,
                       optimizer=OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
                       total_steps=10**6, lr_schedule="cosine", warmup_steps=3, lr_staleness_scaling=mode == "async",
                       lr_linear=(lambda n: 1.0 / n) if mode == "sync" else None, backup_timeout_s=60.0)


def _servers(mode: str, backups: int, *, primary: bool = True) -> list[ShardServer]:
    """A primary (unless not `primary`) and `backups` backups, serving on loopback."""
    plan, shapes, init = _setup()
    servers = [ShardServer(_config(mode), plan, init, shapes=shapes, backup=not primary or i > 0)
               for i in range(int(primary) + backups)]
    for s in servers:
        s.start()
    return servers


def _client(primary: ShardServer, sender: str, codec: str | None, chunks: list[int] | None = None) -> ShardClient:
    _, shapes, _ = _setup()
    compressor = None if codec is None else ChunkCompressor(codec, primary.plan, shapes=shapes, seed=len(sender))
    return ShardClient(experiment="enc", sender=sender, plan=primary.plan, endpoints={0: primary.endpoint},
                       chunks=chunks, compressor=compressor, timeout_s=60)


def _grads(plan: ShardPlan, g: torch.Generator, chunks: list[int] | None = None) -> dict[int, torch.Tensor]:
    return {c.index: torch.randn(c.numel, generator=g) for c in plan.chunks if chunks is None or c.index in chunks}


def _assert_identical(a: ShardServer, b: ShardServer) -> None:
    assert a.version == b.version
    for x, y in zip(a.values().values(), b.values().values(), strict=True):
        assert torch.equal(x, y)
    opt_a, opt_b = a.state_dict()["optimizer"]["state"], b.state_dict()["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys() and opt_a
    for i in opt_a:
        assert torch.equal(opt_a[i]["momentum_buffer"], opt_b[i]["momentum_buffer"])


def _wait(pred: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_async_compressed_pushes_are_forwarded_encoded_and_backups_stay_bit_identical() -> None:
    primary, backup, late = _servers("async", backups=2)
    plan = primary.plan
    half = [c.index for c in plan.chunks][: len(plan.chunks) // 2]
    rest = [c.index for c in plan.chunks if c.index not in half]
    clients = {codec: _client(primary, f"w-{codec}", codec) for codec in ("int8", "topk:0.01", "powersgd:2")}
    plain = _client(primary, "w-plain", None)
    # One worker of two local ranks: its update arrives in two int8 PUSH parts.
    ranks = (_client(primary, "w-ranks", "int8", half), _client(primary, "w-ranks", "int8", rest))
    g = torch.Generator().manual_seed(1)
    basis = {name: 0 for name in (*clients, "plain", "ranks")}

    def one_round(clock: int) -> None:
        for codec, client in clients.items():
            basis[codec] = client.push_pull(_grads(plan, g), clock=clock, basis={0: basis[codec]}).versions[0]
        basis["plain"] = plain.push_pull(_grads(plan, g), clock=clock, basis={0: basis["plain"]}).versions[0]
        ranks[0].push_async(_grads(plan, g, half), clock=clock, basis={0: basis["ranks"]})
        ranks[1].push_pull(_grads(plan, g, rest), clock=clock, basis={0: basis["ranks"]})
        basis["ranks"] = ranks[0].wait().versions[0]

    try:
        primary.post(lambda: primary.set_backup(backup.endpoint))
        _wait(lambda: primary.replicated, "the backup to sync")
        for clock in range(3):
            one_round(clock)
        # Each push was acknowledged once its backup held it: the backup holds the same bits now.
        assert primary.version == 15
        _assert_identical(primary, backup)
        # A replacement backup: a full SYNC first, then the encoded updates.
        primary.post(lambda: primary.set_backup(late.endpoint))
        for clock in range(3, 6):
            one_round(clock)
        _wait(lambda: late.version == primary.version == 30, "the late backup to catch up")
        _assert_identical(primary, late)
        st = primary.stats()
        # Every update was replicated; all but the uncompressed worker's went as the compressed pushes.
        assert st["replicated_updates"] == 30 and st["replicated_encoded"] == 24, st
        assert st["backup_detaches"] == 0, st
        assert late.stats()["applied"] == {f"w-{c}": 5 for c in (*clients, "plain", "ranks")}
    finally:
        for c in (*clients.values(), plain, *ranks):
            c.close()
        for s in (primary, backup, late):
            s.close()


@pytest.mark.parametrize(("codec", "encoded"), [("topk:0.01", True), ("powersgd:2", True), ("fp16", False)])
def test_a_sync_step_forwards_every_workers_push_in_order_or_the_sum_when_that_is_smaller(
        codec: str, encoded: bool) -> None:
    """Three workers: the backup adds their decoded pushes in the primary's order, (a + b) + c, and gets
    the same bits (PowerSGD's pushes are dense and overlap, so adding them in another order changes the
    bits: checked by reversing the backup's order, which fails this case); three fp16 pushes are larger
    than the fp32 sum, so that sum is forwarded instead."""
    primary, backup = _servers("sync", backups=1)
    plan = primary.plan
    workers = [_client(primary, f"w{i}", codec) for i in range(3)]
    g = torch.Generator().manual_seed(2)
    steps = 4
    try:
        primary.post(lambda: primary.set_backup(backup.endpoint))
        _wait(lambda: primary.replicated, "the backup to sync")
        with ThreadPoolExecutor(3) as pool:
            for step in range(steps):
                grads = [_grads(plan, g) for _ in workers]
                futures = [pool.submit(w.push_pull, gr, clock=step, basis={0: step}, step=step, num_workers=3)
                           for w, gr in zip(workers, grads, strict=True)]
                for f in futures:
                    f.result(timeout=60)
        assert primary.version == steps
        _assert_identical(primary, backup)
        st = primary.stats()
        assert st["replicated_updates"] == steps and st["replicated_encoded"] == (steps if encoded else 0), st
    finally:
        for w in workers:
            w.close()
        for s in (primary, backup):
            s.close()


def _ask(sock: zmq.Socket, msg: Message) -> Message:
    sock.send_multipart(encode(msg))
    assert sock.poll(60_000), f"no reply to {msg.op}"
    return decode(sock.recv_multipart(), FrameLimits())


def test_only_the_primary_may_replicate_encoded_and_a_malformed_forward_changes_nothing() -> None:
    """An encoded REPLICATE is admitted as a dense one is (the primary's token, its epoch), checked part by
    part, and applies the same bits as the dense gradient it decodes to."""
    encoded_backup, dense_backup = _servers("async", backups=2, primary=False)
    plan, shapes, _ = _setup()
    key = new_key()
    ctx = zmq.Context()
    socks = []
    try:
        for s in (encoded_backup, dense_backup):
            s.set_sender_key(key)
        enc = ChunkCompressor("topk:0.05", plan, shapes=shapes)
        g = torch.Generator().manual_seed(3)
        tensors: dict[str, torch.Tensor] = {}
        chunks: dict[str, Any] = {}
        for c in plan.chunks:
            t, meta = enc.encode(c.index, torch.randn(c.numel, generator=g))
            tensors.update(t)
            chunks[str(c.index)] = meta
        part = PushCompression(chunks=chunks, codec=enc.default_spec)
        primary = primary_sender(0)

        def replicate(sender: str, parts: tuple[PushCompression, ...], named: dict[str, torch.Tensor],
                      version: int = 1) -> Message:
            meta = {**ReplicateMeta(lr_factor=0.7, applied=(("w", 0),), parts=parts).to_meta(),
                    **Authority(auth=token_for(key, sender), epoch=0).to_meta()}
            return Message(op="REPLICATE", experiment="enc", shard=0, version=version, sender=sender, meta=meta,
                           tensors=named)

        forwarded = {f"p0/{n}": t for n, t in tensors.items()}
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(encoded_backup.endpoint)
        socks.append(sock)
        refusals = [
            (replicate("w", (part,), forwarded), UNAUTHENTICATED),  # a worker's own valid token
            (replicate(primary, (part,), {**forwarded, "p1/c0/0/values": torch.zeros(3)}), INVALID_ARGUMENT),
            (replicate(primary, (part,), {k: v for k, v in forwarded.items() if not k.startswith("p0/c0/")}),
             INVALID_ARGUMENT),  # a chunk's payload missing
            # Chunk 0 twice, the others once: not a whole update.
            (replicate(primary, (part, PushCompression(chunks={"0": chunks["0"]}, codec=enc.default_spec)),
                       {**forwarded, **{f"p1/{n}": t for n, t in tensors.items() if n.startswith("c0/")}}),
             INVALID_ARGUMENT),
        ]
        for msg, code in refusals:
            reply = _ask(sock, msg)
            assert reply.op == "ERROR" and reply.meta["code"] == code, (reply.op, reply.meta)
        assert encoded_backup.version == 0
        ack = _ask(sock, replicate(primary, (part,), forwarded))
        assert ack.op == "ACK", ack.meta
        # The same update as the dense gradient it decodes to, to another backup: the same bits.
        dec = ChunkCompressor("topk:0.05", plan, shapes=shapes)
        dense = {f"c{c.index}": dec.decode(c.index, tensors, chunks[str(c.index)]) for c in plan.chunks}
        sock2 = ctx.socket(zmq.DEALER)
        sock2.setsockopt(zmq.LINGER, 0)
        sock2.connect(dense_backup.endpoint)
        socks.append(sock2)
        assert _ask(sock2, replicate(primary, (), dense)).op == "ACK"
        _assert_identical(encoded_backup, dense_backup)
        assert encoded_backup.version == 1 and encoded_backup.stats()["applied"] == {"w": 0}
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
        for s in (encoded_backup, dense_backup):
            s.close()


def test_a_backup_refuses_a_malformed_encoded_replicate_naming_the_fault_and_keeps_serving() -> None:
    """Forwards whose parts do not add up (a part count the tensors do not match, chunks covered unevenly,
    an unknown codec, payload sizes the plan contradicts, huge declared sizes, a payload no smaller than
    the dense gradient) are each refused with an ERROR naming the fault, before anything is allocated at
    the declared size; the backup applies nothing of them and then applies a valid forward."""
    (backup,) = _servers("async", backups=1, primary=False)
    plan, shapes, _ = _setup()
    key = new_key()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        backup.set_sender_key(key)
        sock.connect(backup.endpoint)
        g = torch.Generator().manual_seed(4)

        def encoded(codec: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            enc = ChunkCompressor(codec, plan, shapes=shapes)
            meta: dict[str, Any] = {"compression": {}, "codec": enc.default_spec}
            tensors: dict[str, torch.Tensor] = {}
            for c in plan.chunks:
                t, chunk_meta = enc.encode(c.index, torch.randn(c.numel, generator=g))
                tensors.update(t)
                meta["compression"][str(c.index)] = chunk_meta
            return meta, tensors

        def replicate(parts: Any, named: dict[str, torch.Tensor]) -> Message:
            meta = {"lr_factor": 1.0, "applied": [["w", 0]], "delay": 0, "parts": parts,
                    **Authority(auth=token_for(key, primary_sender(0)), epoch=0).to_meta()}
            return Message(op="REPLICATE", experiment="enc", shard=0, version=1, sender=primary_sender(0), meta=meta,
                           tensors=named)

        def edited(meta: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
            out = copy.deepcopy(meta)
            node = out
            for step in path[:-1]:
                node = node[step]
            node[path[-1]] = value
            return out

        def named(tensors: dict[str, torch.Tensor], k: int = 0, **replaced: torch.Tensor) -> dict[str, torch.Tensor]:
            return {f"p{k}/{n}": replaced.get(n.replace("/", "_"), t) for n, t in tensors.items()}

        topk, topk_t = encoded("topk:0.05")
        int8, int8_t = encoded("int8")
        psgd, psgd_t = encoded("powersgd:2")
        seg = ("compression", "0", "segments", 0)
        k0 = topk_t["c0/0/values"].numel()
        cases: list[tuple[str, Message, str]] = [
            ("parts not a list", replicate({"0": topk}, named(topk_t)), "'parts' must be a list"),
            ("a part without compression", replicate([{"codec": "int8"}], named(int8_t)), r"'parts'\[0\]"),
            ("two parts declared, one sent", replicate([topk, topk], named(topk_t)), "declares 2 pushes"),
            ("a tensor of an undeclared part", replicate([topk], {**named(topk_t), **named(topk_t, 1)}),
             "none of its 1 forwarded pushes"),
            ("chunk 0 covered twice", replicate([topk, {"compression": {"0": topk["compression"]["0"]},
                                                        "codec": topk["codec"]}],
                                                {**named(topk_t), **named({n: t for n, t in topk_t.items()
                                                                           if n.startswith("c0/")}, 1)}),
             "cover every chunk"),
            ("an unknown codec", replicate([{**topk, "codec": "bogus:3"}], named(topk_t)), "unknown codec 'bogus:3'"),
            ("top-k values and indices of different sizes",
             replicate([topk], named(topk_t, c0_0_values=topk_t["c0/0/values"][: k0 - 3])),
             f"'values' has shape \\[{k0 - 3}\\], expected \\[{k0}\\]"),
            ("top-k index past the chunk",
             replicate([topk], named(topk_t, c0_0_indices=torch.full((k0,), 30_000, dtype=torch.int16))),
             "index out of range"),
            ("int8 codes short of the chunk",
             replicate([int8], named(int8_t, c0_0_q=int8_t["c0/0/q"][:-8])), "'q' has shape"),
            ("a chunk of 10^12 values", replicate([edited(int8, ("compression", "0", "numel"), 10**12)],
                                                  named(int8_t)), "meta says 1000000000000 values"),
            ("a segment of 10^12 values", replicate([edited(int8, (*seg, "numel"), 10**12)], named(int8_t)),
             r"\+1000000000000\]"),
            ("a PowerSGD rank of 10^9", replicate([edited(psgd, (*seg, "meta", "rank"), 10**9)], named(psgd_t)),
             "'rank'=1000000000 is outside"),
            ("five int8 pushes: more bytes than the dense gradient",
             replicate([int8] * 5, {n: t for k in range(5) for n, t in named(int8_t, k).items()}),
             "not less than the .* B dense gradient"),
        ]
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for what, msg, match in cases:
            reply = _ask(sock, msg)
            assert reply.op == "ERROR" and reply.meta["code"] == INVALID_ARGUMENT, (what, reply.op, reply.meta)
            assert re.search(match, reply.meta["error"]), (what, reply.meta["error"])
        # Nothing was allocated at a declared size (10^12 fp32 values would be 4 TB): the peak RSS of
        # this process (primary-less backup in process) barely moved.
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        assert grown_mib < 64, grown_mib
        assert backup.version == 0 and backup.stats()["applied"] == {}
        assert _ask(sock, replicate([psgd], named(psgd_t))).op == "ACK"
        assert backup.version == 1 and backup.stats()["applied"] == {"w": 0}
    finally:
        sock.close()
        ctx.term()
        backup.close()
