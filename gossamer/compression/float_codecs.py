"""Codecs that send every value as a float: `none` (fp32), `fp16` and `bf16`."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from gossamer.compression.codec import Codec, Payload, all_finite, fp32_slack, payload_tensor

__all__ = ["BF16Codec", "FP16Codec", "NoneCodec"]


class _CastCodec(Codec):
    """Send `values`, the flattened tensor cast to `wire_dtype`."""

    wire_dtype: ClassVar[torch.dtype]

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        flat = x.reshape(-1)
        if flat.dtype != self.wire_dtype:
            flat = self._to_wire(flat)
        # Contiguous and owned: the caller may modify `x` while the payload waits to be sent.
        return Payload({"values": flat.clone() if flat.data_ptr() == x.data_ptr() else flat})

    def _to_wire(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.to(self.wire_dtype)

    def _decode(self, p: Payload, shape: tuple[int, ...]) -> torch.Tensor:
        v = payload_tensor(p, "values", self.wire_dtype, (math.prod(shape),))
        return v.float()

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
    mantissa_bits: ClassVar[int] = 10
    half_ulp_subnormal: ClassVar[float] = 2.0**-25


class BF16Codec(_HalfCodec):
    """bfloat16 (fp32's exponent range, 8 significant bits), 2x smaller; bf16 values are exact.

    Error bound: |x - x'| <= 2**-8 |x| + 2**-134; magnitudes above bf16's largest finite
    value (about 3.39e38) are clamped to it.
    """

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
    mantissa_bits: ClassVar[int] = 7
    half_ulp_subnormal: ClassVar[float] = 2.0**-134
