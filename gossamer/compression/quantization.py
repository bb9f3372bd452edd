"""Quantizing codecs: blockwise absmax `int8` and stochastic `qsgd:L`."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from gossamer.compression.codec import (
    Codec,
    Payload,
    expect_int,
    fp32_slack,
    meta_int,
    payload_tensor,
)
from gossamer.errors import ConfigError, ProtocolError

__all__ = ["INT8_BLOCK", "QSGD_MAX_LEVELS", "Int8Codec", "QSGDCodec"]

INT8_BLOCK = 512
_FP16_SCALE_RANGE = (2.0**-14, 65000.0)  # scales in fp16's normal range travel as fp16
QSGD_MAX_LEVELS = 127
_F32_MAX = float(torch.finfo(torch.float32).max)


def _scales(absmax: torch.Tensor) -> torch.Tensor:
    """Per-block scales: absmax rounded up to fp16 when every nonzero one fits, else fp32."""
    lo, hi = _FP16_SCALE_RANGE
    nonzero = absmax[absmax > 0]
    if nonzero.numel() and bool(nonzero.min() >= lo) and bool(nonzero.max() <= hi):
        up = (absmax * (1 + 2.0**-10)).half()  # >= absmax after rounding to nearest
        return torch.where(absmax > 0, up, torch.zeros_like(up))
    return absmax.float()


class Int8Codec(Codec):
    """Blockwise absmax int8 quantization (as bitsandbytes' blockwise 8-bit, block 512).

    The flattened tensor is cut into blocks of 512; each block sends a scale s >= its
    absmax and every value as ``round(127 * x / s)`` in int8. The scales travel as fp16
    (s = absmax rounded up to fp16) when all lie in fp16's normal range, else as fp32 (s =
    absmax). About 3.98x smaller.

    Payload: ``q`` int8 (numel,) in [-127, 127]; ``absmax`` fp16 or fp32
    (ceil(numel / 512),) >= 0; meta ``{"block": 512}``.

    Error bound: |x - x'| <= s / 254 <= absmax(block of x) * (1 + 2**-10) / 254 (round to
    nearest), plus fp32 round-off. Deterministic and nearly unbiased, but counted as biased (rounding is not
    stochastic), so error feedback is on by default.
    """

    name: ClassVar[str] = "int8"

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1).float()
        n = flat.numel()
        pad = -n % INT8_BLOCK
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, INT8_BLOCK)

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        n = x.numel()
        blocks = self._blocks(x)
        absmax = _scales(blocks.abs().amax(dim=1) if n else blocks.new_zeros(0))
        safe = torch.where(absmax > 0, absmax.float(), torch.ones_like(absmax, dtype=torch.float32))
        # Dividing by absmax (not multiplying by 127/absmax) keeps subnormal blocks exact-ish
        # and never overflows: the quotient lies in [-1, 1].
        q = torch.round(blocks / safe[:, None] * 127).clamp_(-127, 127).to(torch.int8)
        return Payload(
            {"q": q.reshape(-1)[:n].clone(), "absmax": absmax.contiguous()},
            {"block": INT8_BLOCK},
        )

    def _decode(self, p: Payload, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        nblocks = -(-n // INT8_BLOCK)
        meta_int(p, "block", INT8_BLOCK, INT8_BLOCK)
        q = payload_tensor(p, "q", torch.int8, (n,))
        sent = p.tensors.get("absmax")
        sdtype = (
            torch.float16
            if isinstance(sent, torch.Tensor) and sent.dtype == torch.float16
            else torch.float32
        )
        absmax = payload_tensor(p, "absmax", sdtype, (nblocks,)).float()
        if n and bool((q == -128).any()):
            raise ProtocolError("int8: quantized value -128 is outside [-127, 127]")
        if nblocks and bool((absmax < 0).any()):
            raise ProtocolError("int8: negative absmax scale")
        scale = absmax.repeat_interleave(INT8_BLOCK)[:n]
        return q.float() / 127 * scale

    def _layout(self, shape: tuple[int, ...]) -> tuple[set[str], set[str]]:
        return {"q", "absmax"}, {"block"}

    def _payload_bytes(self, shape: tuple[int, ...]) -> int:
        n = math.prod(shape)
        return n + 2 * -(-n // INT8_BLOCK)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        blocks = self._blocks(t.detach())
        absmax = _scales(blocks.abs().amax(dim=1)).double() if n else t.new_zeros(0)
        per = absmax.repeat_interleave(INT8_BLOCK)[:n].reshape(t.shape)
        return per / 254 * (1 + 2.0**-18) + fp32_slack(per) + fp32_slack(t)


class QSGDCodec(Codec):
    """QSGD stochastic quantization with `levels` levels (Alistarh et al. 2017).

    https://arxiv.org/abs/1610.02132 -- each value is sent as ``norm * sign * l / L`` where
    ``l`` is ``|x| / norm * L`` rounded up or down at random so that the result is unbiased:
    E[decode(encode(x))] = x. ``norm`` is the L2 norm of the whole tensor.

    Payload: ``norm`` fp32 (1,) >= 0 (rounded up from the exact norm); ``levels`` int8
    (numel,) holding ``sign * l`` in [-L, L]; meta ``{"levels": L}``. About 4x smaller.

    Error bound: |x - x'| <= norm / L per element (with probability one), plus fp32
    round-off; the variance is at most min(d / L**2, sqrt(d) / L) * norm**2 in total.

    Args:
        levels: L, 1..127.
        seed: seeds a private generator (reproducible draws, for tests); None uses torch's
            global generator.
    """

    name: ClassVar[str] = "qsgd"

    def __init__(self, levels: int, *, seed: int | None = None) -> None:
        if (
            not isinstance(levels, int)
            or isinstance(levels, bool)
            or not 1 <= levels <= QSGD_MAX_LEVELS
        ):
            raise ConfigError("codec", f"qsgd levels must be 1..{QSGD_MAX_LEVELS}, got {levels!r}")
        self.levels = levels
        self._gen = None if seed is None else torch.Generator().manual_seed(seed)

    @classmethod
    def from_arg(cls, arg: int | float | None, *, seed: int | None = None) -> QSGDCodec:
        return cls(expect_int(arg), seed=seed)

    @property
    def spec(self) -> str:
        return f"qsgd:{self.levels}"

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        flat = x.reshape(-1).float()
        norm64 = float(torch.linalg.vector_norm(flat, dtype=torch.float64)) if flat.numel() else 0.0
        if norm64 > _F32_MAX:
            raise ValueError("qsgd: the tensor's norm exceeds the fp32 range")
        norm = torch.tensor([norm64], dtype=torch.float32)
        if float(norm) < norm64:  # round up, so |x| / norm <= 1 and no level is clipped
            norm = torch.nextafter(norm, torch.tensor([math.inf]))
        scaled = flat.abs() / float(norm) * self.levels if norm64 > 0 else torch.zeros_like(flat)
        low = scaled.floor()
        # fp32 draws: the rounding probability is off by at most 2**-24 of a level.
        u = torch.rand(flat.numel(), generator=self._gen)
        level = (low + (u < scaled - low).float()).clamp_(0, self.levels)
        signed = (torch.sign(flat) * level).to(torch.int8)
        return Payload({"norm": norm, "levels": signed}, {"levels": self.levels})

    def _decode(self, p: Payload, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        meta_int(p, "levels", self.levels, self.levels)
        norm = payload_tensor(p, "norm", torch.float32, (1,))
        levels = payload_tensor(p, "levels", torch.int8, (n,))
        if float(norm) < 0:
            raise ProtocolError("qsgd: negative norm")
        if n and int(levels.abs().max()) > self.levels:  # int8 abs(-128) is -128: check both
            raise ProtocolError(f"qsgd: a level is outside [-{self.levels}, {self.levels}]")
        if n and int(levels.min()) < -self.levels:
            raise ProtocolError(f"qsgd: a level is outside [-{self.levels}, {self.levels}]")
        return levels.float() / self.levels * norm

    def _layout(self, shape: tuple[int, ...]) -> tuple[set[str], set[str]]:
        return {"norm", "levels"}, {"levels"}

    def _payload_bytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) + 4

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        norm = float(torch.linalg.vector_norm(t.detach().double())) if t.numel() else 0.0
        step = norm / self.levels * (1 + 2.0**-18)
        return torch.full(t.shape, step, dtype=torch.float64) + fp32_slack(t) + 2.0**-148
