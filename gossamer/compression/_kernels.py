"""Cache-sized loops for the codecs: each pass over a large tensor runs chunk by chunk in reused scratch."""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["CHUNK", "Scratch", "finite_sum", "pack_signs", "spans"]

#: Values per chunk: 4 MiB of fp32, so a chunk written by one op is still in cache when the
#: next op (a finiteness check, a rounding) reads it. One pass over DRAM instead of three.
CHUNK = 1 << 20

# (bytes b0..b7 of 0/1) * this >> 56 puts b0 in bit 7 ... b7 in bit 0 (no carries reach
# those bits); as int64 the product wraps, which is the arithmetic we want.
_PACK_MAGIC = 0x8040201008040201 - (1 << 64)


def spans(n: int, size: int = CHUNK) -> Iterator[tuple[int, int]]:
    """(lo, hi) of consecutive chunks covering [0, n)."""
    for lo in range(0, n, size):
        yield lo, min(n, lo + size)


class Scratch:
    """Reused chunk-sized buffers of one codec instance (codecs are not thread-safe)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        """A flat buffer of `n` <= CHUNK elements of `dtype` (contents unspecified)."""
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < n:
            buf = self._bufs[dtype] = torch.empty(max(n, min(CHUNK, 1 << 16)), dtype=dtype)
        return buf[:n]


def finite_sum(t: torch.Tensor) -> bool:
    """Whether a sum over `t` is finite (so no NaN/Inf in it when it cannot overflow)."""
    return bool(torch.isfinite(t.sum()))


def pack_signs(flat: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """Bits ``flat >= 0`` packed into uint8, most significant first, zero-padded (`sign.pack_bits`)."""
    n = flat.numel()
    nbytes = -(-n // 8)
    packed = torch.empty(nbytes, dtype=torch.uint8)
    whole = n // 8 * 8
    for lo, hi in spans(whole):
        bits = scratch.get(torch.bool, hi - lo)
        torch.ge(flat[lo:hi], 0, out=bits)
        words = bits.view(torch.uint8).view(torch.int64)
        words = words.mul(_PACK_MAGIC).bitwise_right_shift_(56)
        packed[lo // 8 : hi // 8].copy_(words)  # the low byte: int64 -> uint8 truncates
    if whole < n:
        tail = torch.zeros(8, dtype=torch.bool)
        tail[: n - whole] = flat[whole:] >= 0
        word = tail.view(torch.uint8).view(torch.int64).mul(_PACK_MAGIC).bitwise_right_shift_(56)
        packed[-1] = word.bitwise_and_(0xFF)[0]
    return packed
