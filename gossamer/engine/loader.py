"""The training batches of a rank's steps, read ahead of the step where the experiment asks (`prefetch`, `num_workers`)."""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import DataLoader

from gossamer.engine.batches import Data, Selection, collate_items
from gossamer.engine.stream_blocks import Blocks, keep, unpack_blocks

__all__ = ["StepLoader", "Want", "index_tuple", "want_len"]

#: Which samples a step takes, as a plain hashable value: ("idx", indices) of a map-style set, or
#: ("span", start, stop): the stream positions [start, stop).
Want = tuple[Any, ...]


#: DataLoader workers are forked from the role process. A role forked by the node's fork server inherits
#: multiprocessing's "forkserver" default, under which each role started a fork server of its own for its
#: loader, importing torch and the role code again (about 4 s of CPU) before its first batch.
_FORK = "fork" if "fork" in mp.get_all_start_methods() else None


def index_tuple(sel: Selection) -> tuple[int, ...]:
    """Sample indices as a tuple of ints (a tensor in one call: element by element cost ~2 us each)."""
    return tuple(sel.tolist()) if isinstance(sel, torch.Tensor) else tuple(int(i) for i in sel)


def want_len(want: Want) -> int:
    """How many samples `want` picks."""
    return len(want[1]) if want[0] == "idx" else want[2] - want[1]


class StepLoader:
    """Batches for steps, by step number and the samples each takes (`want_at(step)`, under today's membership).

    `prefetch` > 0 reads that many future steps' batches ahead in a background thread, under
    the assumption that the membership holds (a batch read for a step whose samples changed
    is dropped and read again). `num_workers` > 0 reads a map-style set in DataLoader worker
    processes (batches in flight: `prefetch` per worker, default 2); a stream is then iterated
    through a DataLoader with those workers (the stream must split itself across them by
    `torch.utils.data.get_worker_info()`, as any IterableDataset under a DataLoader must).
    """

    def __init__(self, data: Data, *, num_workers: int = 0, prefetch: int = 0) -> None:
        self.data, self.num_workers, self.depth = data, num_workers, prefetch
        if num_workers and data.stream:
            data.iterate = self._stream_through_workers
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self._pending: dict[tuple[int, Want], Future[Any]] = {}
        self._workers: Iterator[Any] | None = None  # map-style DataLoader over planned steps
        self._planned: deque[tuple[int, Want]] = deque()

    def get(self, step: int, want_at: Callable[[int], Want]) -> Any:
        """The batch of `step` (on CPU), whose samples `want_at(step)` names."""
        want = want_at(step)
        if self.num_workers and not self.data.stream:
            return self._from_workers(step, want, want_at)
        if self._pool is None:
            return self.make(want)
        fut = self._pending.pop((step, want), None) or self._pool.submit(self.make, want)
        for key in [k for k in self._pending if k[0] <= step]:  # steps done, or read for another membership
            self._pending.pop(key).cancel()
        for ahead in range(step + 1, step + 1 + self.depth):
            key = (ahead, want_at(ahead))
            if key not in self._pending:
                self._pending[key] = self._pool.submit(self.make, key[1])
        return fut.result()

    def make(self, want: Want) -> Any:
        """Read the batch `want` names, here and now."""
        if want[0] == "idx":
            return self.data.batch(torch.tensor(want[1], dtype=torch.long))
        return self.data.batch(self.data.read(want[1], want[2]))

    def close(self) -> None:
        self._workers = None  # its worker processes end with the iterator
        if self._pool is not None:
            for fut in self._pending.values():
                fut.cancel()
            self._pool.shutdown(wait=False)

    # --- DataLoader worker processes --------------------------------------------------------
    def _from_workers(self, step: int, want: Want, want_at: Callable[[int], Want]) -> Any:
        if self._workers is None or not self._planned or self._planned[0] != (step, want):
            self._workers, self._planned = None, deque()  # a new membership or a jump: plan again from here
            self._workers = iter(self._loader(step, want_at))
        batch = next(self._workers)
        self._planned.popleft()
        return batch

    def _loader(self, start: int, want_at: Callable[[int], Want]) -> DataLoader[Any]:
        planned = self._planned

        def plan() -> Iterator[list[int]]:
            step = start
            while True:
                want = want_at(step)
                planned.append((step, want))
                yield list(want[1])
                step += 1

        collate = self.data.collate
        return DataLoader(self.data.ds, batch_sampler=plan(), num_workers=self.num_workers,  # type: ignore[arg-type]
                          prefetch_factor=self.depth or 2, collate_fn=lambda items: collate_items(items, collate),
                          multiprocessing_context=_FORK)

    def _stream_through_workers(self) -> Iterator[Any]:
        return unpack_blocks(iter(DataLoader(Blocks(self.data.ds), batch_size=None, collate_fn=keep,
                                             num_workers=self.num_workers, prefetch_factor=self.depth or 2,
                                             multiprocessing_context=_FORK)))
