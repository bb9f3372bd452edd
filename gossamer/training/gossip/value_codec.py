"""Which compression codecs gossip can use: those that send parameter values, not differences."""

from __future__ import annotations

from gossamer.compression.codec import Codec
from gossamer.compression.codec_spec import parse_codec
from gossamer.core.codec_table import ADAPTIVE, CODECS, grammar
from gossamer.core.errors import ConfigError

__all__ = ["GOSSIP_CODECS", "parse_value_codec"]

#: Codec families push-sum accepts (`CodecEntry.carries_values`; qsgd takes its level count, "qsgd:L").
GOSSIP_CODECS: tuple[str, ...] = tuple(e.name for e in CODECS if e.carries_values)
_NEED_REFERENCE = frozenset({ADAPTIVE, *(e.name for e in CODECS if not e.carries_values)})


def parse_value_codec(spec: str, *, seed: int | None = None, field: str = "compression") -> Codec:
    """The codec for push-sum messages, refusing codecs that only make sense on gradients.

    Raises:
        ConfigError: `spec` is not a value codec (or not a codec at all).
    """
    name = spec.strip().partition(":")[0] if isinstance(spec, str) else ""
    if name in _NEED_REFERENCE:
        *most, last = grammar(values_only=True).split("|")
        raise ConfigError(
            field,
            f"{spec!r} cannot be used in gossip mode: gossip exchanges parameters, not "
            "gradients, and sparse/sign/low-rank codecs would drop most of each value; they "
            "need a shared reference copy of the neighbour's parameters to send differences "
            f"against (CHOCO-SGD), which push-sum does not keep. Use {', '.join(most)} or {last}",
        )
    return parse_codec(spec, seed=seed, field=field)
