"""A checkpoint snapshot that costs serving nothing: it holds the live tensors, and writes to them go aside."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gossamer.checkpoint.sharded import ShardSnapshot
from gossamer.paramserver._copy_on_write import storage_of

__all__ = ["PendingSnapshot", "copy_in_background"]


@dataclass
class _Chunk:
    """One chunk of a pending snapshot: the live tensors and, on the same storages, the snapshot's."""

    offset: int
    live: dict[str, torch.Tensor]  # "param" and the optimizer's tensors, as the state holds them
    held: dict[str, torch.Tensor]  # aliases of their storages when the snapshot was opened
    ready: dict[str, torch.Tensor] | None = None  # the copier's copies, not handed over yet
    settled: bool = False  # its piece is in the snapshot

    def still_live(self) -> list[str]:
        """The tensors the state still writes to on the snapshot's storage (frozen until copied)."""
        return [name for name, t in self.live.items() if storage_of(t) == storage_of(self.held[name])]

    def copies(self) -> dict[str, torch.Tensor]:
        """Copies of the snapshot's tensors (safe without the lock: nothing writes a frozen storage)."""
        return {name: t.clone() for name, t in self.held.items()}


class PendingSnapshot:
    """The shard's state at one version, without a copy on the serve thread.

    Opening it takes aliases of the live tensors and freezes their storages: while the
    snapshot is pending, the state writes to them out of place (`WritesAside`), so the
    aliases keep this version's values and an update never waits for a copy. A copier thread
    copies the chunks from the last (an update walks them from the first), reading the frozen
    aliases without the shard's lock, and publishes each copy; the copy becomes the chunk's
    piece, which unfreezes the chunk (writes to it are in place again), as soon as the lock
    is free or an update reaches the chunk, whichever comes first (`release`). A chunk an
    update moved first keeps the alias, which nothing writes to any more. Either way each
    piece holds the version the snapshot was opened at, and the memory is one copy of the
    state, as a copying snapshot's; an update pays at most the new memory of the chunks the
    copier has not reached.
    """

    def __init__(self, skeleton: ShardSnapshot, sources: list[tuple[int, torch.Tensor, dict[str, Any]]]) -> None:
        """`skeleton`: the snapshot's fields with no pieces yet; `sources`: (flat offset, chunk
        values, the optimizer's state of the chunk) of every chunk, all live (not copies)."""
        self.snapshot = skeleton
        self._chunks: list[_Chunk] = []
        for offset, value, state in sources:
            live: dict[str, torch.Tensor] = {"param": value}
            scalars: dict[str, float] = {}
            for name, val in state.items():
                if isinstance(val, torch.Tensor) and val.dim() > 0:
                    live[name] = val
                elif isinstance(val, torch.Tensor):
                    scalars[name] = float(val.item())  # scalars are small: read now, whatever moves them
                elif isinstance(val, int | float):
                    scalars[name] = float(val)
            if scalars:
                self.snapshot.scalars[offset] = scalars
            held = {name: t.detach().reshape(-1) for name, t in live.items()}
            self._chunks.append(_Chunk(offset, live, held))
        self._by_storage = {storage_of(t): c for c in self._chunks for t in c.held.values()}
        self.copy_order = tuple(reversed(self._chunks))  # the copier's: from the last chunk
        self.copied = 0  # chunks the copier copied (their live tensors stayed where they were)
        self.adopted = 0  # chunks whose live tensors a write moved off (the snapshot keeps the storage)
        self.serve_copies = 0  # tensors the serve thread copied for it (a write with no out-of-place twin)
        self.finish_seconds = 0.0  # what the serve thread paid: copies for writes it could not turn around

    @property
    def done(self) -> bool:
        """Every piece is the snapshot's own (copied, or left behind by a write)."""
        self.settle()
        return all(c.settled for c in self._chunks)

    @property
    def published(self) -> int:
        """Chunks whose copy the copier has made and not handed over yet."""
        return sum(1 for c in self._chunks if c.ready is not None and not c.settled)

    def frozen(self) -> set[int]:
        """The storages a write must leave alone: the snapshot's, still under the live state."""
        return {storage_of(c.held[name]) for c in self._chunks if not c.settled for name in c.still_live()}

    def settle(self) -> None:
        """Hand over the copies published so far; chunks every tensor of which a write moved off
        are the snapshot's as they are (call under the lock)."""
        for c in self._chunks:
            if c.settled:
                continue
            if c.ready is not None:
                self._put_copy(c, c.ready)
            elif not c.still_live():
                self._put(c, c.held)
                self.adopted += 1

    def release(self, storage: int) -> set[int]:
        """A write is about to reach `storage`: if the copier has published the copy of its
        chunk, the copy becomes the piece; returns the storages no longer frozen (call under
        the lock)."""
        c = self._by_storage.get(storage)
        if c is None or c.settled or c.ready is None:
            return set()
        freed = {storage_of(c.held[name]) for name in c.still_live()}
        self._put_copy(c, c.ready)
        return freed

    def to_copy(self) -> list[_Chunk]:
        """The chunks for the copier, last first (call under the lock)."""
        self.settle()
        return [c for c in reversed(self._chunks) if not c.settled]

    def copy_next(self) -> bool:
        """Copy one more chunk on this thread (the caller holds the lock); False once none is left."""
        todo = self.to_copy()
        if not todo:
            return False
        todo[0].ready = todo[0].copies()
        self.settle()
        return True

    def _put_copy(self, c: _Chunk, copies: dict[str, torch.Tensor]) -> None:
        still = set(c.still_live())  # a tensor a write moved off keeps its alias: nothing writes it
        self._put(c, {name: copies[name] if name in still else held for name, held in c.held.items()})
        if still:
            self.copied += 1
        else:  # every tensor moved off before the copy was handed over: the copy goes unused
            self.adopted += 1

    def _put(self, c: _Chunk, tensors: dict[str, torch.Tensor]) -> None:
        self.snapshot.pieces[c.offset] = tensors
        c.settled, c.ready, c.held, c.live = True, None, {}, {}

    def note_write(self, copies: int, seconds: float) -> None:
        """A write ran beside this snapshot: `copies` tensors had to be copied first, in `seconds`."""
        self.serve_copies += copies
        self.finish_seconds += seconds
        self.settle()


def copy_in_background(pending: PendingSnapshot, lock: Any, deliver: Callable[[ShardSnapshot], object]) -> None:
    """The copier thread's body: copy each chunk without the lock (its storages are frozen),
    publish the copy, hand copies over whenever the lock is free, then give the whole
    snapshot to `deliver`."""
    for chunk in pending.copy_order:
        if chunk.settled:  # an update moved it off, or took its copy
            continue
        chunk.ready = chunk.copies()  # one assignment: a reader sees no copy or all of it
        if chunk.settled:  # handed over meanwhile (or moved off): the copy is not needed
            chunk.ready = None
        if lock.acquire(blocking=False):
            try:
                pending.settle()
            finally:
                lock.release()
    with lock:
        pending.settle()
    deliver(pending.snapshot)
