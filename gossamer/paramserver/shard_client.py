"""Worker side of the parameter server: push gradients and pull parameters over DEALER sockets."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar, Unpack

import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import UnavailableError
from gossamer.core.protocol import HelloMeta
from gossamer.paramserver._pull_side import PullResult, PullSide
from gossamer.paramserver._push_side import PushRound, PushSide
from gossamer.paramserver._shard_link import LinkOptions, ShardLink, logger, poll_ms

__all__ = ["PullResult", "ShardClient", "poll_ms"]

T = TypeVar("T")


class _Of(Generic[T]):
    """A client attribute that is the attribute of the same name of one of its parts: read there, set there."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, client: ShardClient, owner: type | None = None) -> T:
        value: T = getattr(getattr(client, self.part), self.name)
        return value

    def __set__(self, client: ShardClient, value: T) -> None:
        setattr(getattr(client, self.part), self.name, value)


class ShardClient(ShardLink):
    """Talks to the shards owning `chunks` (default: all chunks) for one sender id.

    Several local ranks of one worker use the same `sender` with disjoint `chunks`; a shard
    applies the worker's update once it has every chunk. Requests to different shards are
    sent first and collected after, so shards work in parallel. Gradient tensors handed to
    `push_pull` are sent zero-copy; they are not read any more once it returns.

    A link (`ShardLink`: the sockets, the request/reply loop and the traffic counters) with two
    parts: `pulls` (`pull`, and the values in every reply read out) and `pushes` (gradients
    encoded and sent: `push_pull`, or `push_async` then `wait` or `abandon`).
    """

    # What the trainers and tests read or set on the client, kept by the part that uses it.
    pull_codec = _Of[str]("pulls")
    pull_decoder = _Of[ChunkCompressor | None]("pulls")
    compressor = _Of[ChunkCompressor | None]("pushes")
    fault_ctx = _Of[dict[str, int]]("pushes")
    fault_step = _Of[int]("pushes")

    def __init__(
        self,
        *,
        compressor: ChunkCompressor | None = None,
        pull_codec: str = "none",
        shapes: Mapping[str, Sequence[int]] | None = None,
        **link: Unpack[LinkOptions],
    ) -> None:
        """`link`: the link's settings (`LinkOptions`: experiment, sender, plan and endpoints at least);
        `compressor` encodes pushed gradients; `pull_codec` asks shards for compressed parameter differences
        instead of full values (see ShardServer); `shapes`: the parameters' shapes, for the pull decoder
        (default: the compressor's), as the shards know them."""
        super().__init__(**link)
        pull_decoder = None
        if pull_codec != "none":
            pull_decoder = ChunkCompressor(pull_codec, self.plan, error_feedback=False, shapes=shapes
                                           if shapes is not None else compressor.shapes if compressor is not None
                                           else None)
        self.pulls = PullSide(self, pull_codec=pull_codec, pull_decoder=pull_decoder)
        self.pushes = PushSide(self, self.pulls, compressor)

    def chunks_of_shard(self, shard: int) -> list[int]:
        return list(self.by_shard.get(shard, []))

    # -- API --------------------------------------------------------------------------
    def hello(self, fresh: bool = False) -> None:
        """Register this sender as an active worker on every involved shard.

        `fresh`: this is a new process under this sender id (its clocks start over).
        """
        self.request({s: self.msg("HELLO", s, HelloMeta(fresh=fresh).to_meta()) for s in self.shards})

    def pull(self, shards: Iterable[int] | None = None, timeout_s: float | None = None,
             chunks: Iterable[int] | None = None) -> PullResult:
        """Current values of this client's chunks (only of those on `shards`, if given, and of `chunks`, if given;
        `timeout_s`: not the default)."""
        return self.pulls.pull(shards, timeout_s, chunks)

    def push_pull(
        self,
        grads: dict[int, torch.Tensor],
        *,
        clock: int,
        basis: dict[int, int],
        step: int | None = None,
        num_workers: int | None = None,
        generation: int | None = None,
        consume: bool = False,
        values: bool = True,
        idle: bool = False,
    ) -> PullResult:
        """Push gradients (by chunk index) and return the new values of those chunks.

        `basis` maps shard -> the version the gradients were computed on; in sync mode pass
        `step` and `num_workers`. `consume` with a compressor: `grads` is emptied once encoded.
        `values` False: the shards answer with their versions and the end flag only (an ack), and
        the caller pulls the values (`pull` with `chunks`); a shard that predates the ack sends them.
        A large dense push under a barrier goes in parts, one at a time per shard (`push_parts`), and
        the values of those shards are pulled after the step. `idle`: a done worker's place in a barrier round
        (`PushMeta.idle`).

        Raises:
            ShardError: a shard rejected the push (nothing of it was applied there).
            UnavailableError: a shard did not answer within `timeout_s`.
        """
        push = PushRound(clock=clock, basis=basis, step=step, num_workers=num_workers, generation=generation,
                         values=values, idle=idle)
        return self.pushes.push_pull(grads, push, consume=consume)

    def push_async(self, grads: dict[int, torch.Tensor], *, clock: int, basis: dict[int, int]) -> None:
        """Send a push and return at once; `wait()` collects its reply (one in flight at most).

        The gradients are snapshotted, so the caller may overwrite its buffers right away.
        """
        self.pushes.push_async(grads, clock=clock, basis=basis)

    def wait(self) -> PullResult:
        """The reply to the push sent by `push_async`."""
        return self.pushes.wait()

    def abandon(self) -> None:
        """Forget the push in flight (its late reply is dropped by request id)."""
        self.pushes.abandon()

    @property
    def in_flight(self) -> bool:
        return self.pushes.in_flight

    def stats(self, shard: int) -> dict[str, Any]:
        """The STATS reply of `shard` (histogram keys as ints)."""
        if shard not in self.socks:
            self.socks[shard] = self.connect(shard)
        meta = dict(self.request({shard: self.msg("STATS", shard)})[shard].meta)
        meta.pop("rid", None)
        for key in ("staleness", "version_staleness"):
            meta[key] = {int(k): v for k, v in meta.get(key, {}).items()}
        return meta

    def probe(self, nbytes: int = 256 * 1024, repeats: int = 1) -> tuple[float, float]:
        """Measure the link to the first shard: (bare round trip s, round trip s with `nbytes`).

        Pairs of round trips through the same socket (and throttle) as pushes: a tiny STATS,
        then one carrying `nbytes` of padding; the least of `repeats` of each (a stall of
        either process only ever lengthens a trip). What the bytes cost is the padded trip
        minus the link's latency (`compression.adaptive.BaseLatency` keeps it from bare trips).
        """
        shard = self.shards[0]
        pad = torch.zeros(nbytes, dtype=torch.uint8)
        bare = padded = math.inf
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            self.request({shard: self.msg("STATS", shard)})
            t1 = time.perf_counter()
            self.request({shard: self.msg("STATS", shard, tensors={"probe": pad})})
            bare, padded = min(bare, t1 - t0), min(padded, time.perf_counter() - t1)
        return bare, padded

    def leave(self, timeout_s: float = 3.0) -> None:
        """Leave the active set of every involved shard (releases SSP waits on us).

        Best effort: a shard already gone (the job ended, its node left) is not waited on
        for longer than `timeout_s`.
        """
        try:
            self.collect(self.send({s: self.msg("LEAVE", s) for s in self.shards}), timeout_s)
        except UnavailableError as e:
            logger.info("LEAVE not answered (%s); the shards will drop us by membership", e)

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
