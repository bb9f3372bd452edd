"""A shard client's pulls: its chunks' values asked of the shards, and rebuilt from compressed differences."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import ProtocolError, ShardError
from gossamer.core.protocol import ParamsMeta, PullMeta, parse_chunk_key
from gossamer.paramserver._shard_link import ShardLink
from gossamer.paramserver.pulled_values import apply_deltas
from gossamer.transport.frames import Message


@dataclass
class PullResult:
    """Parameters returned by a pull or push: chunk values by index, shard versions."""

    versions: dict[int, int]
    values: dict[int, torch.Tensor]
    done: bool
    staleness: dict[int, int] = field(default_factory=dict)


class PullSide:
    """Pulls over a `ShardLink`, and the values in every reply (a pull's or a push's) read out."""

    def __init__(self, link: ShardLink, *, pull_codec: str, pull_decoder: ChunkCompressor | None) -> None:
        """`pull_codec`: ask shards for compressed parameter differences instead of full values (see
        ShardServer), decoded by `pull_decoder` (None without a pull codec)."""
        self.link = link
        self.pull_codec = pull_codec
        self.pull_decoder = pull_decoder
        self._held: dict[int, torch.Tensor] = {}  # chunk values we hold (pull compression)

    def pull(self, shards: Iterable[int] | None = None, timeout_s: float | None = None,
             chunks: Iterable[int] | None = None) -> PullResult:
        """Current values of this client's chunks (only of those on `shards`, if given, and of `chunks`, if given;
        `timeout_s`: not the default)."""
        link = self.link
        only = None if chunks is None else set(chunks)
        reqs = {
            s: link.msg("PULL", s, PullMeta(chunks=tuple(i for i in link.by_shard[s] if only is None or i in only),
                                            pull_codec=self.pull_codec).to_meta())
            for s in (link.shards if shards is None else shards)
        }
        return self.result(link.collect(link.send(reqs), timeout_s))

    def result(self, replies: dict[int, Message]) -> PullResult:
        """The values, versions and end flag the shards' `replies` carry."""
        t0 = time.perf_counter()
        try:
            return self._values_of(replies)
        finally:
            self.link.decode_s += time.perf_counter() - t0

    def _values_of(self, replies: dict[int, Message]) -> PullResult:
        values: dict[int, torch.Tensor] = {}
        versions: dict[int, int] = {}
        staleness: dict[int, int] = {}
        done = False
        for s, reply in replies.items():
            try:
                meta = ParamsMeta.from_meta(reply.meta)
            except ProtocolError as e:
                raise ShardError(f"shard {s} sent a malformed reply: {e}") from e
            versions[s] = reply.version
            if meta.applied is not None:
                self.link.applied[s] = meta.applied
            if meta.steps is not None:
                self.link.steps[s] = meta.steps
            done = done or meta.done
            if meta.staleness is not None:
                staleness[s] = meta.staleness
            compressed = meta.pull_compression
            for name, t in reply.tensors.items():
                if "/" not in name:
                    values[parse_chunk_key(name)] = t
            if compressed:
                values.update(apply_deltas(self.pull_decoder, self._held, s, reply, compressed))
            for idx in values:
                self.link.raw_bytes_down += 4 * self.link.plan.chunks[idx].numel
            if self.pull_decoder is not None:
                self._held.update(values)
        return PullResult(versions=versions, values=values, done=done, staleness=staleness)
