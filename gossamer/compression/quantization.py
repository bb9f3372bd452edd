"""Quantizing codecs: blockwise absmax `int8` and stochastic `qsgd:L`."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from gossamer.compression import _jit
from gossamer.compression._kernels import CHUNK, Scratch, finite_sum, spans
from gossamer.compression.codec import (
    Codec,
    Payload,
    all_finite,
    expect_int,
    fp32_slack,
    into,
    meta_int,
    payload_tensor,
)
from gossamer.compression.wire_pool import WirePool
from gossamer.core.errors import ConfigError, ProtocolError

__all__ = ["INT8_BLOCK", "QSGD_BUCKET", "QSGD_MAX_LEVELS", "Int8Codec", "QSGDCodec"]

INT8_BLOCK = 512
_FP16_SCALE_RANGE = (2.0**-14, 65000.0)  # scales in fp16's normal range travel as fp16
QSGD_MAX_LEVELS = 127
# One norm per 512 values, as the QSGD paper's experiments: the variance is then bounded by
# the bucket's size, not the tensor's (a whole-tensor norm drowns a large tensor in noise).
QSGD_BUCKET = 512
_F32_MAX = float(torch.finfo(torch.float32).max)


def _rows(flat: torch.Tensor, size: int) -> torch.Tensor:
    """`flat` zero-padded to a multiple of `size` and viewed as rows of `size` values."""
    pad = -flat.numel() % size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, size)


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
        return _rows(x.reshape(-1).float(), INT8_BLOCK)

    checks_finite: ClassVar[bool] = True
    decodes_finite: ClassVar[bool] = True  # |q / 127 * scale| <= scale, a finite number

    def __init__(self) -> None:
        self._scratch = Scratch()
        self._pool = WirePool()

    def release_buffers(self) -> None:
        self._pool.clear()

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        if x.dtype == torch.float32 and x.numel() >= INT8_BLOCK:
            flat = x.reshape(-1)
            fast = self._encode_jit(flat, key) if _jit.available(flat.numel()) else None
            if fast is None:
                fast = self._encode_chunked(flat, key)
            if fast is not None:
                return fast
        if not all_finite(x):
            raise ValueError(f"{self.spec}: cannot encode a tensor holding NaN or Inf")
        return self._encode_whole(x)

    def _encode_whole(self, x: torch.Tensor) -> Payload:
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

    def _encode_jit(self, flat: torch.Tensor, key: str | None) -> Payload | None:
        """`_encode_chunked`'s payload, byte for byte, from the numba kernel; None as there."""
        n = flat.numel()
        q = self._pool.take(key, torch.int8, n)
        absmax = torch.empty(-(-n // INT8_BLOCK), dtype=torch.float16)
        bits = absmax.view(torch.int16)
        statuses = _jit.call_parts(
            "int8_encode", n, INT8_BLOCK * 16,  # whole groups of blocks (`_numba_kernels`) but the last
            lambda lo, hi: (flat[lo:hi], q[lo:hi], bits[lo // INT8_BLOCK : -(-hi // INT8_BLOCK)]),
        )
        if statuses is None or min(statuses) < 0:
            return None
        # no nonzero scale: fp32 zeros, as `_scales`
        return Payload({"q": q, "absmax": absmax if max(statuses) else absmax.float()}, {"block": INT8_BLOCK})

    def _encode_chunked(self, flat: torch.Tensor, key: str | None) -> Payload | None:
        """`_encode_whole`'s payload in one pass over `flat`, chunk by chunk in cache.

        It bets that every scale fits fp16 (the usual case) and checks the scales once at
        the end; None when they do not, or when `flat` holds NaN/Inf (a NaN block max), and
        the caller takes the careful path.
        """
        n = flat.numel()
        nblocks = -(-n // INT8_BLOCK)
        whole = n // INT8_BLOCK * INT8_BLOCK
        q = self._pool.take(key, torch.int8, n)
        amax = torch.empty(nblocks, dtype=torch.float32)
        absmax = torch.empty(nblocks, dtype=torch.float16)
        step = CHUNK // INT8_BLOCK * INT8_BLOCK
        for lo, hi in spans(whole, step):
            b0, b1 = lo // INT8_BLOCK, hi // INT8_BLOCK
            blocks = flat[lo:hi].view(-1, INT8_BLOCK)
            work = self._scratch.get(torch.float32, hi - lo).view(-1, INT8_BLOCK)
            torch.amax(torch.abs(blocks, out=work), dim=1, out=amax[b0:b1])
            self._quantize(blocks, amax[b0:b1], absmax[b0:b1], work, q[lo:hi])
        if whole < n:
            tail = flat[whole:].view(1, -1)
            work = self._scratch.get(torch.float32, n - whole).view(1, -1)
            torch.amax(torch.abs(tail, out=work), dim=1, out=amax[-1:])
            self._quantize(tail, amax[-1:], absmax[-1:], work, q[whole:])
        lo_s, hi_s = _FP16_SCALE_RANGE
        nz = amax[amax > 0]
        if not finite_sum(amax) or (nz.numel() and not bool((nz.min() >= lo_s) & (nz.max() <= hi_s))):
            return None
        if not nz.numel():
            return Payload({"q": q, "absmax": absmax.float()}, {"block": INT8_BLOCK})  # as `_scales`
        return Payload({"q": q, "absmax": absmax}, {"block": INT8_BLOCK})

    @staticmethod
    def _quantize(
        blocks: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, work: torch.Tensor, q: torch.Tensor
    ) -> None:
        """Blocks (rows) to int8 in `q` and their fp16 scales in `scale`, as `_encode_whole`.

        When the scales pass `_encode_chunked`'s final check, a nonzero one is >= 2**-14 and
        >= its block's absmax: the quotient lies in [-1, 1], so no clamp is needed, and the
        floor of 2**-14 only replaces the zero scale of an all-zero block (0 / 1 before: the
        same zeros).
        """
        scale.copy_(amax * (1 + 2.0**-10))  # as `_scales`: >= absmax after rounding to fp16
        safe = scale.float().clamp_min_(_FP16_SCALE_RANGE[0])
        torch.div(blocks, safe[:, None], out=work).mul_(127).round_()
        q.copy_(work.view(-1))

    def _decode(self, p: Payload, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        n = math.prod(shape)
        nblocks = -(-n // INT8_BLOCK)
        meta_int(p, "block", INT8_BLOCK, INT8_BLOCK)
        sent = p.tensors.get("absmax")
        sdtype = (
            torch.float16
            if isinstance(sent, torch.Tensor) and sent.dtype == torch.float16
            else torch.float32
        )
        absmax = payload_tensor(p, "absmax", sdtype, (nblocks,)).float()
        if nblocks and bool((absmax < 0).any()):
            raise ProtocolError("int8: negative absmax scale")
        raw = p.tensors["q"]
        if raw.dtype != torch.int8 or raw.shape != (n,):
            payload_tensor(p, "q", torch.int8, (n,))  # raises, naming what is wrong
        out = into(out, n)
        if _jit.available(n):
            done = _jit.call_parts(
                "int8_decode", n, INT8_BLOCK,
                lambda lo, hi: (raw[lo:hi], absmax[lo // INT8_BLOCK : -(-hi // INT8_BLOCK)], out[lo:hi]),
            )
            if done is not None and all(done):
                return out
        whole = n // INT8_BLOCK * INT8_BLOCK
        step = CHUNK // INT8_BLOCK * INT8_BLOCK
        # Chunk by chunk: check the range (-128 is not a level; an int8 min costs a sixth of
        # an fp32 one), widen, then scale in place; the same arithmetic as q.float() / 127 * scale.
        for lo, hi in [*spans(whole, step), *([(whole, n)] if whole < n else [])]:
            if bool(raw[lo:hi].min() < -127):
                raise ProtocolError("int8: quantized value -128 is outside [-127, 127]")
            part = out[lo:hi].copy_(raw[lo:hi])
            part.div_(127)
            b0 = lo // INT8_BLOCK
            if hi - lo == (hi - lo) // INT8_BLOCK * INT8_BLOCK:
                part.view(-1, INT8_BLOCK).mul_(absmax[b0 : hi // INT8_BLOCK, None])
            else:
                part.mul_(absmax[b0])
        return out

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
    """Bucketed QSGD stochastic quantization with `levels` levels (Alistarh et al. 2017).

    https://arxiv.org/abs/1610.02132 -- the flattened tensor is cut into buckets of 512
    values (the paper's bucketing); each value is sent as ``norm * sign * l / L`` where
    ``norm`` is the L2 norm of its bucket and ``l`` is ``|x| / norm * L`` rounded up or down
    at random so that the result is unbiased: E[decode(encode(x))] = x.

    Payload: ``norm`` fp32 (ceil(numel / 512),) >= 0 (each rounded up from its bucket's exact
    norm, so no level is clipped); ``levels`` int8 (numel,) holding ``sign * l`` in [-L, L];
    meta ``{"levels": L, "bucket": 512}``. About 3.97x smaller.

    Error bound: |x - x'| <= norm(bucket of x) / L per element (with probability one), plus
    fp32 round-off. The variance of a bucket is at most min(512 / L**2, sqrt(512) / L) *
    norm(bucket)**2 (0.032 of its squared norm at L = 127), so the whole tensor's relative
    variance has that bound whatever its size.

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
        n = flat.numel()
        buckets = _rows(flat, QSGD_BUCKET)
        norm64 = torch.linalg.vector_norm(buckets, dim=1, dtype=torch.float64)
        if n and float(norm64.max()) > _F32_MAX:
            raise ValueError("qsgd: a bucket's norm exceeds the fp32 range")
        norm = norm64.float()
        # Round up, so |x| / norm <= 1 and no level is clipped.
        norm = torch.where(norm.double() < norm64, torch.nextafter(norm, torch.full_like(norm, math.inf)), norm)
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))  # an all-zero bucket: levels 0
        scaled = (buckets.abs() / safe[:, None] * self.levels).reshape(-1)[:n]
        low = scaled.floor()
        # fp32 draws: the rounding probability is off by at most 2**-24 of a level.
        u = torch.rand(n, generator=self._gen)
        level = (low + (u < scaled - low).float()).clamp_(0, self.levels)
        signed = (torch.sign(flat) * level).to(torch.int8)
        return Payload({"norm": norm, "levels": signed}, {"levels": self.levels, "bucket": QSGD_BUCKET})

    def _decode(self, p: Payload, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        n = math.prod(shape)
        meta_int(p, "levels", self.levels, self.levels)
        meta_int(p, "bucket", QSGD_BUCKET, QSGD_BUCKET)
        norm = payload_tensor(p, "norm", torch.float32, (-(-n // QSGD_BUCKET),))
        levels = payload_tensor(p, "levels", torch.int8, (n,))
        if n and bool((norm < 0).any()):
            raise ProtocolError("qsgd: negative norm")
        if n and (int(levels.min()) < -self.levels or int(levels.max()) > self.levels):
            raise ProtocolError(f"qsgd: a level is outside [-{self.levels}, {self.levels}]")
        out = into(out, n)
        out.copy_(levels).div_(self.levels)  # levels.float() / L * norm, in place
        whole = n // QSGD_BUCKET * QSGD_BUCKET
        out[:whole].view(-1, QSGD_BUCKET).mul_(norm[: whole // QSGD_BUCKET, None])
        if whole < n:
            out[whole:].mul_(norm[-1])
        return out

    def _layout(self, shape: tuple[int, ...]) -> tuple[set[str], set[str]]:
        return {"norm", "levels"}, {"levels", "bucket"}

    def _payload_bytes(self, shape: tuple[int, ...]) -> int:
        n = math.prod(shape)
        return n + 4 * -(-n // QSGD_BUCKET)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        norms = torch.linalg.vector_norm(_rows(t.detach().reshape(-1).double(), QSGD_BUCKET), dim=1)
        per = norms.repeat_interleave(QSGD_BUCKET)[:n].reshape(t.shape)
        return per / self.levels * (1 + 2.0**-18) + fp32_slack(t) + 2.0**-148
