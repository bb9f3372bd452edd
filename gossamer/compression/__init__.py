"""Gradient compression: codecs, error feedback, and the per-chunk compressor of the data plane."""

from __future__ import annotations

from gossamer.compression.chunk_codec import ChunkCompressor, Segment
from gossamer.compression.codec import WIRE_DTYPES, Codec, Payload
from gossamer.compression.codec_spec import CODEC_NAMES, parse_codec
from gossamer.compression.error_feedback import ErrorFeedback
from gossamer.compression.float_codecs import BF16Codec, FP16Codec, NoneCodec
from gossamer.compression.powersgd import PowerSGDCodec
from gossamer.compression.quantization import Int8Codec, QSGDCodec
from gossamer.compression.sign import SignCodec
from gossamer.compression.sparsification import TopKCodec

__all__ = [
    "CODEC_NAMES",
    "WIRE_DTYPES",
    "BF16Codec",
    "ChunkCompressor",
    "Codec",
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
