"""Codecs that send every value as a float: `none` (fp32), `fp16` and `bf16`."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from gossamer.compression import _jit
from gossamer.compression._kernels import finite_sum, spans
from gossamer.compression.codec import Codec, Payload, all_finite, fp32_slack, payload_tensor
from gossamer.compression.wire_pool import WirePool

__all__ = ["BF16Codec", "FP16Codec", "NoneCodec"]


class _CastCodec(Codec):
    """Send `values`, the flattened tensor cast to `wire_dtype`."""

    wire_dtype: ClassVar[torch.dtype]
    decodes_finite: ClassVar[bool] = True  # a finite value of a narrower float stays finite
    _decode_kernel: ClassVar[str] = ""  # `_jit` kernels: 16-bit wire values to fp32
    _encode_kernel: ClassVar[str] = ""  # and fp32 to them

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        flat = x.reshape(-1)
        if flat.dtype != self.wire_dtype:
            flat = self._to_wire(flat)
        # Contiguous and owned: the caller may modify `x` while the payload waits to be sent.
        return Payload({"values": flat.clone() if flat.data_ptr() == x.data_ptr() else flat})

    def _to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.to(self.wire_dtype)

    def _decode(self, p: Payload, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        n = math.prod(shape)
        raw = p.tensors["values"]
        kernel = self._decode_kernel
        if kernel and raw.dtype == self.wire_dtype and raw.shape == (n,) and _jit.available(n):
            dst = torch.empty(n, dtype=torch.float32) if out is None else out
            bits = raw.view(torch.int16)
            done = _jit.call_parts(kernel, n, 1, lambda lo, hi: (bits[lo:hi], dst[lo:hi]))
            if done is not None and all(done):
                return dst
        if out is None or raw.dtype != self.wire_dtype or raw.shape != (n,):
            v = payload_tensor(p, "values", self.wire_dtype, (n,))
            return v.float() if out is None else out.copy_(v)
        # Cast chunk by chunk and check the fp32 result while it is in cache: one pass.
        for lo, hi in spans(n):
            if not finite_sum(out[lo:hi].copy_(raw[lo:hi])) and not all_finite(out[lo:hi]):
                payload_tensor(p, "values", self.wire_dtype, (n,))  # raises, naming the tensor
        return out

    def _layout(self, shape: tuple[int, ...]) -> tuple[set[str], set[str]]:
        return {"values"}, set()

    def _payload_bytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.wire_dtype.itemsize


class NoneCodec(_CastCodec):
    """No compression: fp32 values as they are.

    Error bound: exact for fp32, fp16 and bf16 inputs; fp64 inputs are rounded to fp32
    (relative 2**-24), and encoding one outside the fp32 range raises ValueError.
    Decoding into fp32 returns a view of the payload's tensor, not a copy.
    """

    name: ClassVar[str] = "none"
    wire_dtype: ClassVar[torch.dtype] = torch.float32

    def _to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        out = flat.to(torch.float32)
        if not all_finite(out):
            raise ValueError("none: value outside the fp32 range")
        return out

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float64:
            return fp32_slack(t)
        return torch.zeros(t.shape, dtype=torch.float64)


class _HalfCodec(_CastCodec):
    """Round to a 16-bit float, clamping to its largest finite value first (as hivemind)."""

    mantissa_bits: ClassVar[int]
    half_ulp_subnormal: ClassVar[float]
    checks_finite: ClassVar[bool] = True

    def __init__(self) -> None:
        self._pool = WirePool()

    def release_buffers(self) -> None:
        self._pool.clear()

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        flat = x.reshape(-1)
        if flat.dtype == self.wire_dtype:
            if not all_finite(flat):
                raise ValueError(f"{self.spec}: cannot encode a tensor holding NaN or Inf")
            return Payload({"values": flat.clone()})
        if flat.dtype != torch.float32:
            if not all_finite(flat):
                raise ValueError(f"{self.spec}: cannot encode a tensor holding NaN or Inf")
            return Payload({"values": self._to_wire(flat)})
        # fp32, the common case: check each chunk's range (NaN fails the comparison) and cast
        # it while it is in cache. A NaN/Inf or a value past the wire dtype's range sends the
        # whole tensor the careful way, which raises or clamps.
        top = torch.finfo(self.wire_dtype).max
        wire = self._pool.take(key, self.wire_dtype, flat.numel())
        if _jit.available(flat.numel()):
            bits = wire.view(torch.int16)
            done = _jit.call_parts(self._encode_kernel, flat.numel(), 1, lambda lo, hi: (flat[lo:hi], bits[lo:hi]))
            if done is not None and all(done):
                return Payload({"values": wire})
        for lo, hi in spans(flat.numel()):
            mn, mx = torch.aminmax(flat[lo:hi])
            if not bool((mn >= -top) & (mx <= top)):
                if not all_finite(flat):
                    raise ValueError(f"{self.spec}: cannot encode a tensor holding NaN or Inf")
                return Payload({"values": self._to_wire(flat)})
            wire[lo:hi].copy_(flat[lo:hi])
        return Payload({"values": wire})

    def _to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        top = torch.finfo(self.wire_dtype).max
        # Clamp in a dtype that holds `top` exactly (bf16 rounds 65504 up to 65536).
        wide = flat if flat.dtype == torch.float64 else flat.float()
        return wide.clamp(-top, top).to(self.wire_dtype)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        a = t.double().abs()
        top = torch.finfo(self.wire_dtype).max
        rounding = a * 2.0 ** -(self.mantissa_bits + 1) + self.half_ulp_subnormal
        return torch.where(a > top, a - top, rounding) + fp32_slack(t)


class FP16Codec(_HalfCodec):
    """IEEE half precision, 2x smaller; values already in fp16 travel bit-exact.

    Error bound: |x - x'| <= 2**-11 |x| + 2**-25 for |x| <= 65504 (round to nearest, the
    last term for fp16 subnormals); larger magnitudes are clamped to +-65504, an error of
    |x| - 65504.
    """

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16
    _encode_kernel: ClassVar[str] = "fp16_encode"
    _decode_kernel: ClassVar[str] = "fp16_decode"
    mantissa_bits: ClassVar[int] = 10
    half_ulp_subnormal: ClassVar[float] = 2.0**-25


class BF16Codec(_HalfCodec):
    """bfloat16 (fp32's exponent range, 8 significant bits), 2x smaller; bf16 values are exact.

    Error bound: |x - x'| <= 2**-8 |x| + 2**-134; magnitudes above bf16's largest finite
    value (about 3.39e38) are clamped to it.
    """

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
    _encode_kernel: ClassVar[str] = "bf16_encode"
    _decode_kernel: ClassVar[str] = "bf16_decode"
    mantissa_bits: ClassVar[int] = 7
    half_ulp_subnormal: ClassVar[float] = 2.0**-134
