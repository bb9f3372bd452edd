"""Which samples a worker trains on at each step: a pure function of (seed, epoch, step, membership)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, TypeVar

import torch

#: Indices, items read from a stream, or either.
T = TypeVar("T", torch.Tensor, list[Any], range, torch.Tensor | list[Any])


@lru_cache(maxsize=8)  # one permutation per epoch and stream, not one per step
def _epoch_perm(n: int, seed: int, epoch: int, stream: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + stream * 10_007 + epoch) % (2**63))
    return torch.randperm(n, generator=g)


def even_split(items: T, parts: int, part: int) -> T:
    """Part `part` of `parts` near-equal contiguous pieces (the first ones one longer)."""
    n = len(items)
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    return items[start : start + base + (1 if part < extra else 0)]


def sync_global_batch(n: int, global_batch: int, step: int, seed: int) -> torch.Tensor:
    """Indices of the global batch at `step`: the same whatever the number of workers."""
    per_epoch = n // global_batch
    if per_epoch == 0:
        raise ValueError(f"global batch {global_batch} is larger than the data set ({n})")
    epoch, pos = divmod(step, per_epoch)
    return _epoch_perm(n, seed, epoch)[pos * global_batch : (pos + 1) * global_batch]


def async_batch(n: int, batch: int, step: int, seed: int, worker: int) -> torch.Tensor:
    """Indices of worker `worker`'s own batch at its `step` (an independent stream per worker)."""
    batch = min(batch, n)
    per_epoch = n // batch
    epoch, pos = divmod(step, per_epoch)
    return _epoch_perm(n, seed, epoch, stream=worker + 1)[pos * batch : (pos + 1) * batch]


def stream_span(step: int, step_samples: int, parts: int, part: int) -> tuple[int, int]:
    """The positions [start, stop) of a stream that worker `part` of `parts` reads at `step`.

    A step takes the stream's next `step_samples` positions, [step x step_samples, (step + 1) x
    step_samples), cut into `parts` near-equal contiguous pieces, one per current worker. In
    sync `step` is the global step and `step_samples` the global batch, so the step's samples
    are the same whatever the membership; in the other modes `step` is the worker's own step
    and `step_samples` its batch times the workers, so workers at any mix of steps never read
    the same position while the membership holds.
    """
    start = step * step_samples
    base, extra = divmod(step_samples, parts)
    lo = start + part * base + min(part, extra)
    return lo, lo + base + (1 if part < extra else 0)
