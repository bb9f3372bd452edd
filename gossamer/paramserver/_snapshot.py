"""A checkpoint snapshot taken chunk by chunk beside serving: copied in the background, finished before any write."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from gossamer.checkpoint.sharded import ShardSnapshot

__all__ = ["PendingSnapshot", "copy_in_background"]


class PendingSnapshot:
    """The shard's state at one version, copied a chunk at a time.

    A copier thread calls `copy_next` (under the shard's lock, one chunk per hold, so requests
    are served between chunks); whoever is about to change the state first calls `finish`,
    which copies what is left. Either way the copies are of the version the snapshot was
    opened at, and the serve thread copies only what the copier had not reached yet.
    """

    def __init__(self, skeleton: ShardSnapshot, sources: list[tuple[int, torch.Tensor, dict[str, Any]]]) -> None:
        """`skeleton`: the snapshot's fields with no pieces yet; `sources`: (flat offset, chunk
        values, the optimizer's state of the chunk) of every chunk, all live (not copies)."""
        self.snapshot = skeleton
        self._todo: list[tuple[Any, ...]] = list(reversed(sources))
        self.finish_seconds = 0.0  # spent in `finish`: what the serve thread paid

    @property
    def done(self) -> bool:
        return not self._todo

    def copy_next(self) -> bool:
        """Copy one more chunk; False once every chunk is copied."""
        if not self._todo:
            return False
        offset, value, state, *adopted = self._todo.pop()
        entry = {"param": value if adopted else value.detach().clone()}
        scalars: dict[str, float] = {}
        for name, val in state.items():
            if isinstance(val, torch.Tensor) and val.dim() > 0:
                entry[name] = val.detach().reshape(-1).clone()
            elif isinstance(val, torch.Tensor):
                scalars[name] = float(val.item())
            elif isinstance(val, int | float):
                scalars[name] = float(val)
        self.snapshot.pieces[offset] = entry
        if scalars:
            self.snapshot.scalars[offset] = scalars
        return True

    def adopt_values(self) -> None:
        """The live values are about to move to a copy (a send still reads them): the chunks not
        copied yet keep the current storage as their snapshot values instead of copying it."""
        self._todo = [(offset, value.detach(), state, True) for offset, value, state, *_ in self._todo]

    def finish(self) -> None:
        """Copy every chunk left (the state is about to change)."""
        if not self._todo:
            return
        t0 = time.perf_counter()
        while self.copy_next():
            pass
        self.finish_seconds += time.perf_counter() - t0


def copy_in_background(pending: PendingSnapshot, lock: Any, deliver: Callable[[ShardSnapshot], object]) -> None:
    """The copier thread's body: one chunk per lock hold, then hand the snapshot to `deliver`."""
    while True:
        with lock:
            if not pending.copy_next():
                break
        time.sleep(0)  # let the serve thread take the lock between chunks
    deliver(pending.snapshot)
