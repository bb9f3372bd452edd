"""Turn codec spec strings such as "topk:0.01" into codec instances."""

from __future__ import annotations

import math
from collections.abc import Callable

from gossamer.compression.codec import Codec
from gossamer.compression.float_codecs import BF16Codec, FP16Codec, NoneCodec
from gossamer.compression.powersgd import PowerSGDCodec
from gossamer.compression.quantization import Int8Codec, QSGDCodec
from gossamer.compression.sign import SignCodec
from gossamer.compression.sparsification import TopKCodec
from gossamer.errors import ConfigError

__all__ = ["CODEC_NAMES", "parse_codec"]

#: Codec families, in the order of the experiment's `compression` field documentation.
CODEC_NAMES = ("none", "fp16", "bf16", "int8", "qsgd", "topk", "powersgd", "sign")
_PLAIN: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "fp16": FP16Codec,
    "bf16": BF16Codec,
    "int8": Int8Codec,
    "sign": SignCodec,
}


def _int_arg(spec: str, arg: str, field: str) -> int:
    if not (arg.isascii() and arg.isdigit()) or len(arg) > 9:  # "²".isdigit(), but int("²") fails
        raise ConfigError(field, f"{spec!r}: expected a positive integer after ':'")
    return int(arg)


def parse_codec(spec: str, *, seed: int | None = None, field: str = "compression") -> Codec:
    """Build the codec a spec string names; each call returns a fresh instance.

    Args:
        spec: "none" | "fp16" | "bf16" | "int8" | "sign" | "qsgd:L" (1 <= L <= 127) |
            "topk:R" (0 < R <= 1) | "powersgd:K" (K >= 1).
        seed: seeds QSGD's rounding draws and PowerSGD's initial Q (None: QSGD uses the
            global generator, PowerSGD seed 0).
        field: the config field named in errors.

    Raises:
        ConfigError: the spec is not one of the above.
    """
    if not isinstance(spec, str):
        raise ConfigError(field, f"codec spec must be a string, got {type(spec).__name__}")
    name, sep, arg = spec.strip().partition(":")
    try:
        if name in _PLAIN and not sep:
            return _PLAIN[name]()
        if name == "qsgd" and sep:
            return QSGDCodec(_int_arg(spec, arg, field), seed=seed)
        if name == "powersgd" and sep:
            return PowerSGDCodec(_int_arg(spec, arg, field), seed=0 if seed is None else seed)
        if name == "topk" and sep:
            try:
                ratio = float(arg)
            except ValueError:
                raise ConfigError(field, f"{spec!r}: expected a ratio after ':'") from None
            if not math.isfinite(ratio):
                raise ConfigError(field, f"{spec!r}: ratio must be finite")
            return TopKCodec(ratio)
    except ConfigError as e:
        if e.field == field:
            raise
        raise ConfigError(field, str(e).split(": ", 1)[1]) from None
    raise ConfigError(
        field,
        f"unknown codec {spec!r}; expected none|fp16|bf16|int8|sign|qsgd:L|topk:R|powersgd:K",
    )
