"""Turn codec spec strings such as "topk:0.01" into codec instances (the grammar is the registry's)."""

from __future__ import annotations

import importlib

from gossamer.compression.codec import Codec
from gossamer.core.codec_table import CodecEntry, grammar, parse_spec
from gossamer.core.errors import ConfigError

__all__ = ["parse_codec"]


def codec_class(entry: CodecEntry) -> type[Codec]:
    """The `Codec` subclass a codec table line names (imports its module, and so torch)."""
    module, _, attr = entry.cls.partition(":")
    cls: type[Codec] = getattr(importlib.import_module(module), attr)
    return cls


def parse_codec(spec: str, *, seed: int | None = None, field: str = "compression") -> Codec:
    """Build the codec a spec string names; each call returns a fresh instance.

    Args:
        spec: a spec of `gossamer.core.codec_table.CODECS`, e.g. "none" | "fp16" | "bf16"
            | "int8" | "sign" | "qsgd:L" (1 <= L <= 127) | "topk:R" (0 < R <= 1) |
            "powersgd:K" (K >= 1); surrounding spaces are ignored.
        seed: seeds stochastic codecs (QSGD's rounding draws, PowerSGD's initial Q; None:
            QSGD uses the global generator, PowerSGD seed 0).
        field: the config field named in errors.

    Raises:
        ConfigError: naming `field`, when the spec is not one of the registry's.
    """
    if not isinstance(spec, str):
        raise ConfigError(field, f"codec spec must be a string, got {type(spec).__name__}")
    entry, arg = parse_spec(spec.strip(), field=field)
    cls = codec_class(entry)
    try:
        return cls.from_arg(arg, seed=seed)
    except ConfigError as e:  # the class refused what the grammar let through: name our field
        reason = str(e).split(": ", 1)[1]
        raise ConfigError(field, f"{spec!r}: {reason}; expected {grammar()}") from None
