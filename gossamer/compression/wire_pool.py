"""Reused wire buffers: a codec writes a key's next payload into a buffer no one references any more."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

__all__ = ["MIN_POOLED", "WirePool"]

#: Smaller buffers come from malloc's heap, already faulted in: pooling them saves nothing.
MIN_POOLED = 1 << 16

# The reference count of a tensor storage (torch's own tests use it). Without it no buffer
# can be proven free, and every request gets a new one.
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


class _Slot:
    """A pooled tensor and its storage object, with the reference counts of both when idle.

    The pool holds the storage's Python object itself: torch creates one on demand and may
    keep it alive with the storage, which would shift the count by one; held here, the
    counts of an idle buffer are known (`idle_counts` right after creation). Anything else
    that references the memory raises one of them: a tensor or view (numpy arrays and
    memoryviews hold one) raises the storage's use count, a holder of the storage object
    its Python reference count.
    """

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.storage = buf.untyped_storage()
        self.idle_counts = self.counts()

    def counts(self) -> tuple[int, int]:
        assert _use_count is not None
        return _use_count(self.storage._cdata), sys.getrefcount(self.storage)

    def idle(self) -> bool:
        return self.counts() == self.idle_counts


class WirePool:
    """Up to `per_key` flat buffers per key, reused once nothing else references them.

    A payload tensor of 100M values freshly allocated costs its page faults on every encode
    (a 400 MB clone took 70 ms against 30 ms for a copy into a warm buffer). A buffer handed
    out here is a view of a tensor the pool keeps; it is handed out again only when that
    tensor's storage has no other reference: no view, no numpy array, no memoryview. A
    zero-copy ZMQ send (`transport.frames.encode`, ``copy=False``) holds a memoryview of a
    numpy view of the tensor until libzmq has let go of the frame (pyzmq drops it when the
    frame's free callback runs), so a buffer still being sent, queued, or held by the caller
    for a retry is never rewritten: the pool allocates another instead.

    Memory: each key keeps its buffers (at most `per_key`, of the key's latest dtype and
    size) after the payloads are dropped, so between steps a codec holds about one payload
    per key that a fresh allocation would have returned to the system. Not thread-safe
    (codecs are not).
    """

    def __init__(self, per_key: int = 2) -> None:
        self.per_key = per_key
        self._bufs: dict[str, list[_Slot]] = {}
        self.reused = 0  # how many requests a pooled buffer served (for tests and benches)

    def take(self, key: str | None, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat uninitialised tensor of `numel` values of `dtype` that nothing else references.

        `key` None (a one-off encode), a small size, or a torch without storage use counts:
        a new tensor every time.
        """
        if key is None or numel < MIN_POOLED or _use_count is None:
            return torch.empty(numel, dtype=dtype)
        slots = self._bufs.get(key)
        if slots is None or slots[0].buf.dtype != dtype or slots[0].buf.numel() != numel:
            slots = self._bufs[key] = []  # new key, or its size changed: the old buffers go
        for slot in slots:
            if slot.idle():
                self.reused += 1
                return slot.buf.view(-1)
        fresh = torch.empty(numel, dtype=dtype)
        if len(slots) < self.per_key:
            slots.append(_Slot(fresh))
            return fresh.view(-1)
        return fresh

    def clear(self) -> None:
        """Forget every buffer (those still referenced stay alive with their holders)."""
        self._bufs.clear()
