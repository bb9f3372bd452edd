"""Random-k sparsification (`randk:R`): k values at positions both ends derive from a seed in the meta."""

from __future__ import annotations

import math
import zlib
from typing import ClassVar

import torch

from gossamer.compression.codec import (
    Codec,
    Payload,
    expect_float,
    fp32_slack,
    into,
    meta_int,
    payload_tensor,
)
from gossamer.compression.sparsification import fits_fp16, topk_count
from gossamer.core.errors import ConfigError

__all__ = ["SEED_MAX", "RandKCodec", "positions"]

#: Seeds are 32-bit: one msgpack int in the payload meta.
SEED_MAX = 2**32 - 1
_M32 = 0xFFFFFFFF
# Salts of the seed for the permutation's round keys (an xor and a multiplier per round).
_ROUND_SALTS = (0x0, 0x9E3779B9, 0x7F4A7C15, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**32) that mixes every bit (Wellons' "lowbias32"), to draw round keys."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def positions(seed: int, numel: int, k: int) -> torch.Tensor:
    """The k positions of [0, numel) that seed `seed` picks, increasing, as int64.

    They are pi(0), ..., pi(k - 1) for pi a permutation of [0, numel) keyed by the seed:
    three rounds of (xor a key, multiply by an odd key, xor-shift) on b-bit words, b the bits
    of numel - 1, each a bijection of [0, 2**b); values >= numel are mapped again until they
    fall inside (cycle walking, fewer than two rounds on average). Distinct by construction,
    O(k) work, and exact int64 arithmetic: the same on every machine and torch version, which
    is what lets the receiver rebuild the positions instead of receiving them.

    Raises:
        ValueError: numel > 2**32 (the words are at most 32 bits).
    """
    if k >= numel:
        return torch.arange(numel, dtype=torch.int64)
    if numel > 2**32:
        raise ValueError(f"randk: at most 2**32 elements per tensor, got {numel}")
    bits = max(1, (numel - 1).bit_length())
    mask = (1 << bits) - 1
    words = _hash32(torch.tensor([(seed ^ c) & _M32 for c in _ROUND_SALTS], dtype=torch.int64)).tolist()
    rounds = [(words[2 * r] & mask, words[2 * r + 1] | 1) for r in range(len(_ROUND_SALTS) // 2)]
    shift = max(1, (bits + 1) // 2)

    def permute(x: torch.Tensor) -> torch.Tensor:
        for xor, mul in rounds:
            x = _mul32(x ^ xor, mul) & mask
            x = x ^ (x >> shift)
        return x

    out = permute(torch.arange(k, dtype=torch.int64))
    outside = (out >= numel).nonzero().reshape(-1)
    while outside.numel():
        out[outside] = permute(out[outside])
        outside = outside[out[outside] >= numel]
    return torch.sort(out).values


class RandKCodec(Codec):
    """Keep a random `ratio` fraction of the entries, at positions drawn from a shared seed.

    Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018,
    https://arxiv.org/abs/1809.07599 -- random-k with error feedback converges at the rate of
    SGD. Unlike top-k the positions do not depend on the values, so they need not travel:
    the sender draws a 32-bit seed per call (from the codec's seed, the tensor's `key` and
    how many times that key was encoded) and the receiver rebuilds the positions from it
    (`positions`). The payload is ``values`` (k,), fp16 when every kept value is within
    fp16's range, else fp32, with ``k = topk_count(ratio, numel)``; meta ``{"seed": s}``,
    0 <= s < 2**32. 2 bytes per kept entry: ``randk:0.01`` is 200x smaller.

    Error bound: a kept entry is off by its fp16 rounding (round to nearest, never more than
    its magnitude), a dropped entry by its magnitude: |x - x'| <= |x|. Error feedback
    carries what was dropped to the next step, where other positions are drawn.
    Biased (not rescaled by numel / k): use it with error feedback (the default). Error
    feedback then delivers each coordinate's residual in bursts, every ~1/R steps: with
    momentum 0.9 that delayed gradient stalled or diverged digits (shards' momentum, or the
    worker's with DGC's masking), so with the momentum on the worker the sender multiplies by
    `unbiased_scale` and drops error feedback (`ChunkCompressor`'s ``unbiased_random``).

    Args:
        ratio: R in (0, 1].
        seed: the sender's base seed (None: 0); the receiver needs none.
    """

    name: ClassVar[str] = "randk"
    decodes_finite: ClassVar[bool] = True  # validated finite values and zeros

    def __init__(self, ratio: float, *, seed: int | None = None) -> None:
        if (
            not isinstance(ratio, (int, float))
            or isinstance(ratio, bool)
            or not math.isfinite(ratio)
            or not 0 < ratio <= 1
        ):
            raise ConfigError("codec", f"randk ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self._base = 0 if seed is None else int(seed)
        self._calls: dict[str | None, int] = {}
        # The positions of the last seed: an encoder's own decode (error feedback) reuses them.
        self._last: tuple[int, int, int, torch.Tensor] | None = None

    @classmethod
    def from_arg(cls, arg: int | float | None, *, seed: int | None = None) -> RandKCodec:
        return cls(expect_float(arg), seed=seed)

    @property
    def spec(self) -> str:
        return f"randk:{self.ratio!r}"

    def _positions(self, seed: int, n: int, k: int) -> torch.Tensor:
        if self._last is None or self._last[:3] != (seed, n, k):
            self._last = (seed, n, k, positions(seed, n, k))
        return self._last[3]

    def _next_seed(self, key: str | None) -> int:
        count = self._calls.get(key, 0)
        self._calls[key] = count + 1
        return zlib.crc32(f"{self._base}:{key}:{count}".encode())

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        flat = x.reshape(-1)
        n = flat.numel()
        k = topk_count(self.ratio, n)
        seed = self._next_seed(key)
        values = flat[self._positions(seed, n, k)].float()
        if k and fits_fp16(values):
            values = values.half()
        return Payload({"values": values.contiguous()}, {"seed": seed})

    def _decode(self, p: Payload, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        n = math.prod(shape)
        k = topk_count(self.ratio, n)
        seed = meta_int(p, "seed", 0, SEED_MAX)
        raw = p.tensors.get("values")
        half = isinstance(raw, torch.Tensor) and raw.dtype == torch.float16
        values = payload_tensor(p, "values", torch.float16 if half else torch.float32, (k,))
        out = into(out, n).zero_()
        if k:
            out[self._positions(seed, n, k)] = values.float()
        return out

    def unbiased_scale(self, numel: int) -> float:
        """numel / k: what a sender multiplies a tensor of `numel` values by so that decoding is unbiased."""
        k = topk_count(self.ratio, numel)
        return numel / k if k else 1.0

    def _layout(self, shape: tuple[int, ...]) -> tuple[set[str], set[str]]:
        return {"values"}, {"seed"}

    def _payload_bytes(self, shape: tuple[int, ...]) -> int:
        return 2 * topk_count(self.ratio, math.prod(shape))

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().double().abs() + fp32_slack(t)
