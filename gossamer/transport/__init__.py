"""ZMQ + msgpack framing of tensors for the data plane (header frame + raw tensor frames)."""

from __future__ import annotations

from gossamer.transport.frames import (
    DTYPES,
    WIRE_VERSION,
    FrameLimits,
    Message,
    TensorSpec,
    check_finite,
    decode,
    encode,
)

__all__ = [
    "DTYPES",
    "WIRE_VERSION",
    "FrameLimits",
    "Message",
    "TensorSpec",
    "check_finite",
    "decode",
    "encode",
]
