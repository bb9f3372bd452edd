"""A shard client's pushes: gradients encoded per shard, sent whole, in parts or in fragments, and answered."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import ConfigError
from gossamer.core.faults import die_at
from gossamer.core.protocol import PushCompression, PushMeta, chunk_key, parse_chunk_key
from gossamer.paramserver._pull_side import PullResult, PullSide
from gossamer.paramserver._shard_link import ShardLink
from gossamer.paramserver.push_parts import push_rounds
from gossamer.transport.frames import Message


@dataclass(frozen=True)
class PushRound:
    """What a push says of itself: the sender's clock, the shard versions it was computed on (by shard),
    and under a barrier its step, the membership size and generation; `values` False asks for an ack only."""

    clock: int
    basis: dict[int, int]
    step: int | None = None
    num_workers: int | None = None
    generation: int | None = None
    values: bool = True
    idle: bool = False


class PushSide:
    """Pushes over a `ShardLink`: a sync one answered before it returns, or one async push in flight."""

    def __init__(self, link: ShardLink, pulls: PullSide, compressor: ChunkCompressor | None) -> None:
        """`compressor` encodes pushed gradients (None: plain float32 values)."""
        self.link = link
        self.pulls = pulls
        self.compressor = compressor
        self.fault_ctx: dict[str, int] = {}  # worker/rank, for GOSSAMER_FAULT=die:at=mid-pull
        self.fault_step = 0
        link.dense_pushes = self.dense

    def dense(self) -> bool:
        """Whether pushes carry plain values: no codec on the way up, none asked for the way down."""
        return self.compressor is None and self.pulls.pull_codec == "none"

    def requests(self, grads: dict[int, torch.Tensor], push: PushRound) -> dict[int, Message]:
        """One PUSH per shard of `grads` (by chunk index), encoded by the compressor if there is one."""
        link = self.link
        per_shard: dict[int, dict[str, torch.Tensor]] = {}
        for idx, g in grads.items():
            c = link.plan.chunks[idx]
            t = g.detach().reshape(-1)
            if t.dtype != torch.float32:
                t = t.float()
            per_shard.setdefault(c.shard, {})[chunk_key(idx)] = t
        reqs: dict[int, Message] = {}
        for s, tensors in per_shard.items():
            if s not in link.socks:
                raise ConfigError("grads", f"chunks of shard {s} are not this client's")
            meta = PushMeta(clock=push.clock, basis=push.basis.get(s, 0), pull_codec=self.pulls.pull_codec,
                            step=push.step, num_workers=push.num_workers, generation=push.generation,
                            values=push.values, idle=push.idle).to_meta()
            link.raw_bytes_up += sum(4 * t.numel() for t in tensors.values())
            if self.compressor is not None:
                wire: dict[str, torch.Tensor] = {}
                chunk_meta: dict[str, Any] = {}
                for name, t in tensors.items():
                    idx = parse_chunk_key(name)
                    part, chunk_meta[str(idx)] = self.compressor.encode(idx, t)
                    wire.update(part)
                tensors = wire
                meta.update(PushCompression(chunks=chunk_meta, codec=self.compressor.default_spec,
                                            overrides=tuple(self.compressor.overrides)).to_meta())
            reqs[s] = link.msg("PUSH", s, meta, tensors)
        return reqs

    def push_pull(self, grads: dict[int, torch.Tensor], push: PushRound, *, consume: bool = False) -> PullResult:
        """Push gradients and return the new values of those chunks (`ShardClient.push_pull` says more)."""
        link = self.link
        t0 = time.perf_counter()
        reqs = self.requests(grads, push)
        if consume and self.compressor is not None:
            grads.clear()  # encoded: a resend sends the payload, so the caller's buffers can go now
        link.encode_s += time.perf_counter() - t0
        parted: dict[int, list[int]] = {}
        if push.step is not None and self.dense():
            rounds, parted = push_rounds(reqs, lambda s, meta, tensors: link.msg("PUSH", s, meta, tensors))
            for batch in rounds[:-1]:  # each answered once in the step's sum
                link.collect(link.send(batch))
            reqs = rounds[-1]
        sent = link.send(reqs)
        die_at("mid-pull", step=self.fault_step, **self.fault_ctx)  # pushed, reply not read yet
        res = self.pulls.result(link.collect(sent))
        if push.values and parted:
            pulled = self.pulls.pull(list(parted), chunks=[i for chunks in parted.values() for i in chunks])
            res.values.update(pulled.values)
            res.versions.update(pulled.versions)
            res.done = res.done or pulled.done
        return res

    def push_async(self, grads: dict[int, torch.Tensor], *, clock: int, basis: dict[int, int]) -> None:
        """Send a push and return at once; `wait()` collects its reply (one in flight at most).

        The gradients are snapshotted, so the caller may overwrite its buffers right away.
        """
        link = self.link
        t0 = time.perf_counter()
        snap = {i: g.detach().clone() for i, g in grads.items()}
        reqs = self.requests(snap, PushRound(clock=clock, basis=basis))
        link.encode_s += time.perf_counter() - t0
        link.pending_push = link.send(reqs)
        asked = {s: m for s, m in reqs.items() if link.credits.asking(s)}
        if asked:  # a large push goes once granted: wait for that here, so it still travels behind compute
            try:
                link.collect(asked, until_sent=True)
            except BaseException:
                link.pending_push = None
                raise

    def wait(self) -> PullResult:
        """The reply to the push sent by `push_async`."""
        if self.link.pending_push is None:
            raise RuntimeError("no push in flight")
        waiting, self.link.pending_push = self.link.pending_push, None
        return self.pulls.result(self.link.collect(waiting))

    def abandon(self) -> None:
        """Forget the push in flight (its late reply is dropped by request id)."""
        self.link.pending_push = None

    @property
    def in_flight(self) -> bool:
        return self.link.pending_push is not None
