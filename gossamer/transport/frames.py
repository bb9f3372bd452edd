"""The data-plane wire format: a msgpack header frame followed by one raw frame per tensor.

A message on the wire is a list of frames:

* frame 0: a msgpack map ``{"v": 1, "op", "experiment", "shard", "version", "sender",
  "tensors": [{"name", "dtype", "shape", "meta"}, ...], "meta": {...}}`` (a tensor entry's
  "codec" key is reserved: absent or "none");
* frames 1..n: the C-contiguous bytes of each tensor, in header order.

This module is the only place that knows the field names, the wire version and the dtype
names; `tests/data/header_v1.msgpack` pins the header bytes so a format change is a visible
diff. Nothing here ever unpickles: the header is msgpack with string map keys only, and the
tensor frames are read with `torch.frombuffer`.

Buffer ownership (see `encode` and `decode`):

* `encode` references the memory of tensors larger than `ZERO_COPY_THRESHOLD` bytes
  instead of copying it; the caller must keep those tensors unchanged until the send has
  completed (pass `.clone()` snapshots when the source will be mutated while ZMQ may still
  be reading it). Smaller tensors are copied into `bytes`.
* `decode` wraps the received buffers without copying when it may write to them
  (`zmq.Frame` received with ``copy=False`` and writable buffers such as `bytearray`), and
  copies immutable inputs (`bytes`, read-only memoryviews), so every decoded tensor is safe
  to modify in place.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

from gossamer.core.errors import ConfigError, ProtocolError

__all__ = [
    "DTYPES",
    "WIRE_VERSION",
    "ZERO_COPY_THRESHOLD",
    "FrameLimits",
    "Message",
    "TensorSpec",
    "check_finite",
    "decode",
    "encode",
    "frames_nbytes",
    "peek_header",
]

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
# Zero-copy sends hand the buffer to pyzmq's garbage-collector thread, which must take the
# GIL to release it; below about 1 MiB a memcpy is cheaper than that hand-off (measured:
# a 104 KB push took 0.8 ms longer zero-copy than copied on a loaded 2-core machine).
ZERO_COPY_THRESHOLD = 1 << 20
MAX_NDIM = 64
#: The floor of `FrameLimits.for_values`: small models still take a 256 KiB link probe.
MIN_MESSAGE_BYTES = 4 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One entry of the header's ``tensors`` list."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    def to_wire(self) -> dict[str, Any]:
        # "meta" is left out when empty: a compressed push carries one entry per payload
        # tensor, and these bytes would be a tenth of its size.
        wire: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.meta:
            wire["meta"] = self.meta
        return wire


@dataclass
class Message:
    """A decoded data-plane message: header fields plus named tensors (in order)."""

    op: str
    experiment: str = ""
    shard: int = -1
    version: int = 0
    sender: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FrameLimits:
    """Upper bounds enforced by `decode` (and by ZMQ's MAXMSGSIZE on servers)."""

    max_message_bytes: int = 256 << 20
    max_tensors: int = 4096
    max_header_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_tensors", "max_header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive int, got {value!r}")

    @classmethod
    def for_values(cls, numel: int, *, copies: int = 4) -> FrameLimits:
        """Limits for a server whose largest legitimate message holds `copies` fp32 tensors of
        `numel` values, plus a header (at least `MIN_MESSAGE_BYTES`).

        A shard's largest message is the full-state SYNC to its backup: the values and up to
        two optimizer buffers (AdamW), so 3 copies; 4 leaves room for codecs that expand a
        push (top-k at ratio 1 sends values and indices). A gossip peer receives one copy at
        most (a MASS, a snapshot reply).
        """
        if numel < 0 or copies < 1:
            raise ConfigError("numel", f"needs numel >= 0 and copies >= 1, got {numel!r}, {copies!r}")
        default = cls()
        return cls(max_message_bytes=max(MIN_MESSAGE_BYTES, copies * 4 * numel + default.max_header_bytes))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a C-contiguous CPU tensor (bf16 and bool go through uint8)."""
    flat = t.reshape(-1)
    if flat.dtype is not torch.uint8:
        flat = flat.view(torch.uint8)
    # The numpy array keeps a reference to the tensor, so the view keeps the memory alive.
    return flat.numpy().data.cast("B")


def encode(msg: Message) -> list[bytes | memoryview]:
    """Encode `msg` into frames for ``socket.send_multipart(frames, copy=False)``.

    Tensors are moved to CPU and made C-contiguous (a copy only when they are not). The
    bytes of tensors above `ZERO_COPY_THRESHOLD` are *referenced*: the returned memoryview
    keeps the memory alive, but the caller must not modify the tensor until ZMQ has sent it.

    Raises:
        ProtocolError: a tensor has a dtype the wire does not carry.
    """
    specs: list[dict[str, Any]] = []
    frames: list[bytes | memoryview] = [b""]
    for name, tensor in msg.tensors.items():
        t = tensor.detach()
        dtype = _DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            raise ProtocolError(f"tensor {name!r}: dtype {t.dtype} cannot travel on the wire")
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        specs.append(TensorSpec(name=name, dtype=dtype, shape=tuple(t.shape)).to_wire())
        if t.numel() == 0:
            frames.append(b"")
            continue
        view = _tensor_bytes(t)
        frames.append(view if view.nbytes > ZERO_COPY_THRESHOLD else view.tobytes())
    header = {
        "v": WIRE_VERSION,
        "op": msg.op,
        "experiment": msg.experiment,
        "shard": msg.shard,
        "version": msg.version,
        "sender": msg.sender,
        "tensors": specs,
        "meta": msg.meta,
    }
    try:
        frames[0] = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"header of op {msg.op!r} cannot be encoded: {e}") from e
    return frames


def frames_nbytes(frames: Sequence[bytes | memoryview | zmq.Frame]) -> int:
    """Total payload bytes of a list of frames (as counted by the byte counters)."""
    return sum(_frame_len(f) for f in frames)


def _frame_len(frame: bytes | memoryview | zmq.Frame) -> int:
    if isinstance(frame, zmq.Frame):
        return len(frame.buffer)
    if isinstance(frame, memoryview):
        return frame.nbytes
    return len(frame)


def peek_header(frame: bytes | memoryview | zmq.Frame, limits: FrameLimits = FrameLimits()) -> dict[str, Any] | None:
    """The raw header map of frame 0 without validating the message (None if unreadable).

    For answering a request that is refused before it is decoded (rate limit): the reply
    carries the request's ``rid`` so the client matches it.
    """
    if _frame_len(frame) > limits.max_header_bytes:
        return None
    try:
        raw = frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception:  # msgpack raises a zoo of types for bad input
        return None
    return header if isinstance(header, dict) else None


def _frame_buffer(frame: bytes | memoryview | zmq.Frame) -> memoryview | bytearray:
    """A buffer we may write to: received frames as-is, immutable inputs copied."""
    if isinstance(frame, zmq.Frame):
        # A frame received with copy=False owns its libzmq message memory exclusively.
        return frame.buffer
    if isinstance(frame, bytearray):
        return frame
    if isinstance(frame, memoryview) and not frame.readonly and frame.c_contiguous:
        return frame if frame.format == "B" and frame.ndim == 1 else frame.cast("B")
    return bytearray(frame)


def _field(header: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise ProtocolError(f"header is missing field {key!r}")
    value = header[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(
            f"header field {key!r} must be {getattr(kind, '__name__', kind)}, "
            f"got {type(value).__name__}"
        )
    return value


def _parse_spec(i: int, raw: Any) -> TensorSpec:
    if not isinstance(raw, dict):
        raise ProtocolError(f"tensors[{i}] must be a map, got {type(raw).__name__}")
    name = _field(raw, "name", str)
    dtype = _field(raw, "dtype", str)
    if dtype not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: unknown dtype {dtype!r}")
    shape = _field(raw, "shape", list)
    if len(shape) > MAX_NDIM:
        raise ProtocolError(f"tensor {name!r}: {len(shape)} dims exceed {MAX_NDIM}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
    codec = raw.get("codec", "none")
    if codec != "none":  # wire v1 carries raw tensors: compression is described in the message's meta
        raise ProtocolError(f"tensor {name!r}: unsupported codec {codec!r}")
    meta = raw.get("meta", {})
    if not isinstance(meta, dict):
        raise ProtocolError(f"tensor {name!r}: meta must be a map")
    return TensorSpec(name=name, dtype=dtype, shape=tuple(shape), meta=meta)


def decode(
    frames: Sequence[bytes | memoryview | zmq.Frame], limits: FrameLimits = FrameLimits()
) -> Message:
    """Decode and validate frames produced by `encode`.

    Tensors wrap the received buffers without a copy when writing to them is safe
    (``zmq.Frame`` received with ``copy=False``, ``bytearray``, writable memoryviews) and
    are copied otherwise, so the caller may always modify them in place.

    Raises:
        ProtocolError: for anything malformed, inconsistent or over `limits`; decoding
            never raises anything else.
    """
    if not frames:
        raise ProtocolError("empty message: no header frame")
    total = 0
    for f in frames:
        total += _frame_len(f)
        if total > limits.max_message_bytes:
            raise ProtocolError(f"message exceeds max_message_bytes={limits.max_message_bytes}")
    head = frames[0]
    if _frame_len(head) > limits.max_header_bytes:
        raise ProtocolError(
            f"header of {_frame_len(head)} bytes exceeds max_header_bytes={limits.max_header_bytes}"
        )
    try:
        raw_head = head.bytes if isinstance(head, zmq.Frame) else bytes(head)
        header = msgpack.unpackb(raw_head, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    v = header.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v != WIRE_VERSION:
        raise ProtocolError(f"unsupported wire version {v!r} (this build speaks {WIRE_VERSION})")
    op = _field(header, "op", str)
    if not op:
        raise ProtocolError("header field 'op' is empty")
    experiment = _field(header, "experiment", str)
    shard = _field(header, "shard", int)
    version = _field(header, "version", int)
    sender = _field(header, "sender", str)
    raw_specs = _field(header, "tensors", list)
    meta = _field(header, "meta", dict)
    if len(raw_specs) > limits.max_tensors:
        raise ProtocolError(f"{len(raw_specs)} tensors exceed max_tensors={limits.max_tensors}")
    if len(frames) - 1 != len(raw_specs):
        raise ProtocolError(
            f"header lists {len(raw_specs)} tensors but {len(frames) - 1} tensor frames arrived"
        )
    tensors: dict[str, torch.Tensor] = {}
    for i, raw in enumerate(raw_specs):
        spec = _parse_spec(i, raw)
        if spec.name in tensors:
            raise ProtocolError(f"duplicate tensor name {spec.name!r}")
        # An empty tensor's other dims are never checked against frame bytes, and torch
        # overflows (TypeError, RuntimeError) on shapes past int64: bound the declared extent.
        if math.prod(max(d, 1) for d in spec.shape) > limits.max_message_bytes:
            raise ProtocolError(
                f"tensor {spec.name!r}: shape {list(spec.shape)} declares more elements than "
                f"max_message_bytes={limits.max_message_bytes} can hold"
            )
        frame = frames[i + 1]
        got = _frame_len(frame)
        if got != spec.nbytes:
            raise ProtocolError(
                f"tensor {spec.name!r}: frame has {got} bytes, "
                f"{spec.dtype}{list(spec.shape)} needs {spec.nbytes}"
            )
        tensor = _tensor_from_frame(frame, spec)
        if tensor.dtype is torch.bool and bool((tensor.view(torch.uint8) > 1).any()):
            raise ProtocolError(f"tensor {spec.name!r}: bool bytes must be 0 or 1")
        tensors[spec.name] = tensor
    return Message(
        op=op,
        experiment=experiment,
        shard=shard,
        version=version,
        sender=sender,
        meta=meta,
        tensors=tensors,
    )


def _tensor_from_frame(frame: bytes | memoryview | zmq.Frame, spec: TensorSpec) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=dtype)
    buf = _frame_buffer(frame)
    with warnings.catch_warnings():
        # frombuffer warns about non-writable buffers; _frame_buffer only hands writable ones.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(spec.shape)


def check_finite(msg: Message) -> None:
    """Raise ProtocolError naming the first floating-point tensor holding NaN or Inf."""
    for name, t in msg.tensors.items():
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            continue
        if t.numel() == 0:
            continue
        # A sum is cheap and non-finite whenever any element is; only an overflowing sum
        # of finite values needs the exact (allocating) check.
        if bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()):
            continue
        raise ProtocolError(f"tensor {name!r} contains NaN or Inf")
