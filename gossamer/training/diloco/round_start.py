"""A DiLoCo round's start by chunk with the error-feedback residual folded in: one buffer where two were held."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.engine.layout import ReplicatedLayout

__all__ = ["RoundStart"]


class RoundStart:
    """The values theta_0 a DiLoCo round started from, one buffer per chunk, its residual folded in.

    Error feedback keeps, per chunk, what the codec has not delivered yet: e, added to the next
    pseudo-gradient. Held beside theta_0 for the whole round, that was two model-sized buffers.
    Here each chunk holds b = theta_0 + n e (n: the worker count the push divides by), so at the
    round's end (b - theta_H) / n = (theta_0 - theta_H) / n + e is the compensated pseudo-gradient
    itself. It is handed to the compressor (`ChunkCompressor.folded`), which keeps the new residual
    in the same buffer, and the next round's start folds it again: no model-sized allocation per
    round after the first, and numerics equal to compensating apart from fp32 rounding.

    `keep=False` (`round_start="shards"`): nothing is held over the round; a chunk's theta_0 is
    pulled from the shards at the exchange and folded there (`fill`). A chunk whose push was
    refused whole is rebuilt from the residual and what the push carried (`refused`); a chunk
    without a buffer or folded at another worker count is filled again from the shards.
    """

    def __init__(self, layout: ReplicatedLayout, compressor: ChunkCompressor | None, *, keep: bool) -> None:
        self.layout = layout
        self.compressor = compressor
        self.keep = keep
        self.buffers: dict[int, torch.Tensor] = {}
        self.factor: dict[int, int] = {}  # chunk -> the worker count its residual was folded at

    def _feeds_back(self, idx: int) -> bool:
        return self.compressor is not None and self.compressor.feeds_back(idx) is True

    def _now(self, idx: int) -> torch.Tensor:
        """The chunk's current values: a view of the parameters (on their device)."""
        c = self.layout.plan.chunks[idx]
        return self.layout.flat[c.flat_offset : c.flat_offset + c.numel]

    def _fold(self, idx: int, theta0: torch.Tensor, n: int, *, own: bool) -> torch.Tensor:
        """theta0 + n e in e's buffer; theta0 itself (`own`) or a copy of it where the chunk has no residual."""
        r = self.compressor.feedback.take(f"c{idx}") if self.compressor is not None and self._feeds_back(idx) else None
        self.factor[idx] = n
        if r is None:
            return theta0 if own else theta0.clone()
        return r.mul_(n).add_(theta0.to(r.device))

    def begin(self, n: int) -> None:
        """The round starts from the current parameters (`keep`): fold each chunk's residual into them."""
        self.clear()
        if not self.keep:
            return
        for c in self.layout.chunks():
            now = self._now(c.index)
            self.buffers[c.index] = self._fold(c.index, now.to("cpu"), n, own=now.device.type != "cpu")

    def ready(self, chunks: Iterable[int], n: int, *, exact: bool) -> bool:
        """Whether every chunk of `chunks` holds a buffer (`exact`: folded at `n` workers)."""
        return all(i in self.buffers and (not exact or self.factor[i] == n) for i in chunks)

    def fill(self, values: dict[int, torch.Tensor], n: int) -> None:
        """theta_0 of some chunks as the shards hold it (pulled; the tensors are taken): a chunk without a buffer
        folds its residual into it, one folded at another worker count takes its residual out and folds it at `n`."""
        for i, theta0 in values.items():
            b = self.buffers.get(i)
            if b is None:
                self.buffers[i] = self._fold(i, theta0, n, own=True)
            elif self.factor[i] != n:
                b.sub_(theta0).div_(self.factor[i]).mul_(n).add_(theta0)
                self.factor[i] = n

    def pseudo_gradient(self, chunks: Iterable[int], n: int) -> dict[int, torch.Tensor]:
        """(b - theta_H) / n of `chunks`, in their buffers, handed over to the compressor (no longer held here)."""
        out: dict[int, torch.Tensor] = {}
        for i in chunks:
            b = self.buffers.pop(i)
            del self.factor[i]
            out[i] = b.sub_(self._now(i).to(b.device)).mul_(1.0 / n)
            if self._feeds_back(i):
                assert self.compressor is not None
                self.compressor.folded.add(i)
        return out

    def refused(self, chunks: Iterable[int], n: int) -> None:
        """The push of `chunks` (`pseudo_gradient` at `n`) was refused whole: rebuild each buffer from the residual
        the compressor kept and what the push carried. A chunk without feedback is not: `fill` it again."""
        comp = self.compressor
        for i in chunks:
            if comp is None:
                continue
            comp.folded.discard(i)
            if comp.recorded is None or i not in comp.recorded or not self._feeds_back(i):
                continue
            pushed = comp.take_back(i, None)
            if pushed is not None:  # (b - theta_H) / n, as pushed
                self.buffers[i] = pushed.mul_(n).add_(self._now(i).to(pushed.device))
                self.factor[i] = n

    def clear(self) -> None:
        """Drop every buffer (a round given up, or the run's end): their residuals go with them."""
        self.buffers.clear()
        self.factor.clear()
        if self.compressor is not None:
            self.compressor.folded.clear()
