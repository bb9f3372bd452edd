"""A checkpoint snapshot written from the live state, a piece at a time, without a copy of it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from gossamer.checkpoint.sharded import ShardSnapshot
from gossamer.paramserver._copy_on_write import storage_of

__all__ = ["ASIDE_BYTES", "DEFER_S", "WAIT_S", "PendingSnapshot"]

#: Bytes of the snapshot an update may leave aside (write out of place) before it waits for the writer instead.
ASIDE_BYTES = 16 << 20
#: Seconds the serve thread waits for the writer, over one snapshot, before it writes aside whatever is left.
WAIT_S = 2.0
#: Seconds the serve loop keeps pushes back (serving every other request meanwhile) for the writer, over one
#: snapshot, before it applies them anyway (writing aside, or waiting at most `WAIT_S`). Under a worker's
#: timeout at the shard (30 s by default), so a worker kept waiting is not taken for gone.
DEFER_S = 10.0


@dataclass
class _Piece:
    """One tensor of the snapshot: a chunk's values or one of its optimizer buffers."""

    offset: int
    name: str
    # The state's tensor (a write out of place moves it to new memory); None once written, so that a
    # snapshot kept for its counts keeps no tensor the state has replaced since (a SYNC's, a restore's).
    live: torch.Tensor | None
    held: torch.Tensor | None  # an alias of its storage at the snapshot's version; None once written
    storage: int
    nbytes: int
    written: bool = False
    aside: bool = False  # an update moved the live tensor off: the snapshot alone holds that storage

    def still_live(self) -> bool:
        live = self.live  # read once: the writer's thread may let go of it meanwhile
        return not self.written and live is not None and storage_of(live) == self.storage

    def let_go(self) -> None:
        self.written, self.held, self.live = True, None, None


class PendingSnapshot:
    """The shard's state at one version, written to its checkpoint from the live tensors.

    Opening it takes aliases of the live tensors and freezes their storages; the checkpoint
    writer reads each one as it writes it (`take`), in reverse chunk order, and unfreezes it
    once it is in the file (`written`): nothing is copied for the checkpoint. An update that
    reaches a tensor not written yet writes it out of place (`WritesAside`: the snapshot keeps
    the old storage) while the snapshot's tensors left aside stay within `aside_bytes`, and
    past that waits for the writer to write it (it walks the chunks from the first, the writer
    from the last, so they meet once), then writes in place. The memory a checkpoint costs is
    at most `aside_bytes` and the serve thread's wait at most `wait_s` per snapshot (past it,
    what is left is written aside). Either way every piece holds the snapshot's version.
    """

    def __init__(self, skeleton: ShardSnapshot, sources: list[tuple[int, torch.Tensor, dict[str, Any]]], *,
                 aside_bytes: int = ASIDE_BYTES, wait_s: float = WAIT_S, defer_s: float = DEFER_S) -> None:
        """`skeleton`: the snapshot's fields with no pieces yet; `sources`: (flat offset, chunk
        values, the optimizer's state of the chunk) of every chunk, all live (not copies)."""
        self.snapshot = skeleton
        self.aside_bytes = aside_bytes
        self._wait_left = wait_s
        self.defer_s = defer_s
        self._defer_until: float | None = None
        self._pieces: dict[tuple[int, str], _Piece] = {}
        for offset, value, state in sorted(sources, key=lambda s: s[0], reverse=True):  # the writer's order
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
            entry: dict[str, torch.Tensor] = {}
            for name, t in live.items():
                held = t.detach().reshape(-1)
                self._pieces[offset, name] = _Piece(offset, name, t, held, storage_of(held),
                                                    held.numel() * held.element_size())
                entry[name] = torch.empty(held.shape, dtype=held.dtype, device="meta")
            self.snapshot.pieces[offset] = entry
        self.snapshot.stream = self
        self._by_storage = {p.storage: p for p in self._pieces.values()}
        self._cond = threading.Condition()
        self.aside = 0  # bytes of the snapshot that updates left aside (new memory for the live state)
        self.pieces_aside = 0
        self.waits = 0  # writes that waited for the writer to write their piece
        self.wait_seconds = 0.0  # what the serve thread waited for the writer
        self.serve_copies = 0  # tensors the serve thread copied for it (a write with no out-of-place twin)
        self.finish_seconds = 0.0  # what the serve thread paid: waits, and copies for writes it could not turn around

    @property
    def done(self) -> bool:
        """Every piece is written (or the save ended): nothing of the state is frozen for it any more."""
        return all(p.written for p in self._pieces.values())

    @property
    def pieces_in_place(self) -> int:
        """Pieces written straight from the live state (no update moved them meanwhile)."""
        return sum(1 for p in self._pieces.values() if p.written and not p.aside)

    def frozen(self) -> set[int]:
        """The storages a write must leave alone: the snapshot's not written yet, still under the live state."""
        return {p.storage for p in list(self._pieces.values()) if p.still_live()}

    # -- the writer's side (any thread, without the shard's lock) -----------------------------
    def take(self, offset: int, name: str) -> torch.Tensor:
        held = self._pieces[offset, name].held
        if held is None:
            raise RuntimeError(f"snapshot piece {name}/{offset} taken after it was written")
        return held

    def written(self, offset: int, name: str) -> None:
        with self._cond:
            self._pieces[offset, name].let_go()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            for piece in self._pieces.values():
                piece.let_go()
            self._cond.notify_all()

    # -- the serve thread's side (under the shard's lock) ---------------------------------------
    def holds_back(self, now: float) -> bool:
        """An update now would wait for the writer (what it has not written yet is more than the room left
        to write aside): the serve loop keeps updates back and serves the rest meanwhile, for at most
        `defer_s` over this snapshot (counted from the first time it said so)."""
        if self._defer_until is not None and now >= self._defer_until:
            return False
        with self._cond:
            left = sum(p.nbytes for p in self._pieces.values() if p.still_live())
        if left <= self.aside_bytes - self.aside:
            return False
        if self._defer_until is None:
            self._defer_until = now + self.defer_s
        return True

    def release(self, storage: int) -> set[int]:
        """A write is about to reach `storage`: returns {storage} if it may write in place (the
        writer has written it, at once or after a wait), else set() (it writes aside)."""
        piece = self._by_storage.get(storage)
        if piece is None:
            return set()
        with self._cond:
            if not piece.written and self.aside + piece.nbytes > self.aside_bytes and self._wait_left > 0:
                t0 = time.perf_counter()
                self.waits += 1
                self._cond.wait_for(lambda: piece.written, timeout=self._wait_left)
                waited = time.perf_counter() - t0
                self._wait_left -= waited
                self.wait_seconds += waited
                self.finish_seconds += waited
            if piece.written:
                return {storage}
            self.aside += piece.nbytes
            self.pieces_aside += 1
            piece.aside = True
            return set()

    def note_write(self, copies: int, seconds: float) -> None:
        """A write ran beside this snapshot: `copies` tensors had to be copied first, in `seconds`."""
        self.serve_copies += copies
        self.finish_seconds += seconds

    # -- for tests and tools: the whole snapshot in memory -----------------------------------
    def read_all(self) -> ShardSnapshot:
        """Write the pieces not written yet into memory (copies), as a checkpoint writer would, and return them
        as a snapshot."""
        pieces: dict[int, dict[str, torch.Tensor]] = {}
        for (offset, name), piece in list(self._pieces.items()):
            if piece.written:
                continue
            pieces.setdefault(offset, {})[name] = self.take(offset, name).clone()
            self.written(offset, name)
        self.close()
        snap = self.snapshot
        return ShardSnapshot(experiment=snap.experiment, step=snap.step, shard=snap.shard, num_shards=snap.num_shards,
                             total_numel=snap.total_numel, version=snap.version, pieces=pieces,
                             scalars=snap.scalars, layout=snap.layout, extra=snap.extra)
