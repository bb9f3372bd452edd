"""Gradient compression: the codec registry, codecs, error feedback and the data plane's per-chunk compressor."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gossamer.core.codec_table import CODEC_NAMES, CODECS, CodecEntry

if TYPE_CHECKING:
    from gossamer.compression.chunk_codec import ChunkCompressor, Segment
    from gossamer.compression.codec import WIRE_DTYPES, Codec, Payload
    from gossamer.compression.codec_spec import parse_codec
    from gossamer.compression.error_feedback import ErrorFeedback
    from gossamer.compression.float_codecs import BF16Codec, FP16Codec, NoneCodec
    from gossamer.compression.powersgd import PowerSGDCodec
    from gossamer.compression.quantization import Int8Codec, QSGDCodec
    from gossamer.compression.sign import SignCodec
    from gossamer.compression.sparsification import TopKCodec

__all__ = [
    "CODECS",
    "CODEC_NAMES",
    "WIRE_DTYPES",
    "BF16Codec",
    "ChunkCompressor",
    "Codec",
    "CodecEntry",
    "ErrorFeedback",
    "FP16Codec",
    "Int8Codec",
    "NoneCodec",
    "Payload",
    "PowerSGDCodec",
    "QSGDCodec",
    "Segment",
    "SignCodec",
    "TopKCodec",
    "parse_codec",
]

# Loaded on first use, so torch-free processes (the coordinator validating an experiment)
# can read the registry without importing torch.
_LAZY = {
    "ChunkCompressor": "chunk_codec",
    "Segment": "chunk_codec",
    "WIRE_DTYPES": "codec",
    "Codec": "codec",
    "Payload": "codec",
    "parse_codec": "codec_spec",
    "ErrorFeedback": "error_feedback",
    "BF16Codec": "float_codecs",
    "FP16Codec": "float_codecs",
    "NoneCodec": "float_codecs",
    "PowerSGDCodec": "powersgd",
    "Int8Codec": "quantization",
    "QSGDCodec": "quantization",
    "SignCodec": "sign",
    "TopKCodec": "sparsification",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"gossamer.compression.{module}"), name)
