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

    def still_live(self) -> list[str]:
        """The tensors the state still writes to on the snapshot's storage (frozen until copied)."""
        return [name for name, t in self.live.items() if storage_of(t) == storage_of(self.held[name])]


class PendingSnapshot:
    """The shard's state at one version, without a copy on the serve thread.

    Opening it takes aliases of the live tensors and freezes their storages: while the
    snapshot is pending, the state writes to them out of place (`WritesAside`), so the
    aliases keep this version's values and an update never waits for a copy. A copier thread
    copies the chunks the state has not moved off yet (reading the frozen aliases outside the
    shard's lock) and hands each copy over under the lock, which unfreezes the chunk: writes
    to it are in place again. A chunk an update moved first keeps the alias, which nothing
    writes to any more. Either way each piece holds the version the snapshot was opened at,
    and the memory is one copy of the state, as a copying snapshot's.
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
        self._copying: _Chunk | None = None
        self.copied = 0  # chunks the copier copied (their live tensors stayed where they were)
        self.adopted = 0  # chunks whose live tensors a write moved off (the snapshot keeps the storage)
        self.serve_copies = 0  # tensors the serve thread copied for it (a write with no out-of-place twin)
        self.finish_seconds = 0.0  # what the serve thread paid: copies for writes it could not turn around

    @property
    def done(self) -> bool:
        """Every piece is the snapshot's own (copied, or left behind by a write)."""
        self.settle()
        return not self._chunks and self._copying is None

    def frozen(self) -> set[int]:
        """The storages a write must leave alone: the snapshot's, still under the live state."""
        chunks = [*self._chunks, *([self._copying] if self._copying is not None else [])]
        return {storage_of(c.held[name]) for c in chunks for name in c.still_live()}

    def settle(self) -> None:
        """Chunks every tensor of which a write moved off are the snapshot's as they are."""
        for c in [c for c in self._chunks if not c.still_live()]:
            self._chunks.remove(c)
            self._put(c, c.held)
            self.adopted += 1

    def take(self) -> tuple[_Chunk, list[str]] | None:
        """The next chunk for the copier and the names of its tensors to copy (call under the
        lock), or None when none is left."""
        self.settle()
        self._copying = self._chunks.pop(0) if self._chunks else None
        return (self._copying, self._copying.still_live()) if self._copying is not None else None

    def put_copy(self, chunk: _Chunk, copies: dict[str, torch.Tensor]) -> None:
        """The copier's `copies` of `chunk` (made outside the lock) become its piece, for the
        tensors the state still writes to on the snapshot's storage, which are unfrozen; a
        tensor a write moved off meanwhile keeps its alias (call under the lock)."""
        still = set(chunk.still_live())
        self._put(chunk, {name: copies[name] if name in still else held for name, held in chunk.held.items()})
        self._copying = None
        self.copied += 1

    def copy_next(self) -> bool:
        """Copy one more chunk on this thread (the caller holds the lock); False once none is left."""
        job = self.take()
        if job is None:
            return False
        chunk, names = job
        self.put_copy(chunk, {name: chunk.held[name].clone() for name in names})
        return True

    def _put(self, chunk: _Chunk, tensors: dict[str, torch.Tensor]) -> None:
        self.snapshot.pieces[chunk.offset] = tensors

    def note_write(self, copies: int, seconds: float) -> None:
        """A write ran beside this snapshot: `copies` tensors had to be copied first, in `seconds`."""
        self.serve_copies += copies
        self.finish_seconds += seconds
        self.settle()


def copy_in_background(pending: PendingSnapshot, lock: Any, deliver: Callable[[ShardSnapshot], object]) -> None:
    """The copier thread's body: copy each chunk outside the lock (its storage is frozen), hand
    it over under the lock, then give the whole snapshot to `deliver`."""
    while True:
        with lock:
            job = pending.take()
        if job is None:
            break
        chunk, names = job
        copies = {name: chunk.held[name].clone() for name in names}
        with lock:
            pending.put_copy(chunk, copies)
    deliver(pending.snapshot)
