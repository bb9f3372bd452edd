"""The codec interface: a tensor in, a wire-safe payload out, and a validating decode back."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from gossamer.core.codec_table import codec_entry
from gossamer.core.errors import ConfigError, ProtocolError

__all__ = [
    "FLOAT_DTYPES",
    "WIRE_DTYPES",
    "Codec",
    "MetaValue",
    "Payload",
    "all_finite",
    "expect_float",
    "expect_int",
    "fp32_slack",
    "into",
    "meta_float",
    "meta_int",
    "payload_nbytes",
    "payload_tensor",
]

MetaValue = int | float | str | list

#: The dtypes a payload tensor may have (all carried byte-exact by `gossamer.transport.frames`).
WIRE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
#: The dtypes a codec encodes from and decodes into.
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})

# Round-off of fp32 arithmetic in a decode: a relative term and the smallest subnormal.
_F32_REL = 2.0**-22
_F32_TINY = 2.0**-148


@dataclass
class Payload:
    """What a codec puts on the wire: named tensors of `WIRE_DTYPES` and msgpack-safe meta."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, MetaValue] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (the meta travels in the msgpack header)."""
        return payload_nbytes(self.tensors)


def payload_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN/Inf (cheap sum first, exact check after)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def payload_tensor(
    p: Payload, name: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The payload tensor `name`, checked for dtype, shape and (floats) finiteness.

    Raises:
        ProtocolError: it is missing or differs in any of those.
    """
    t = p.tensors.get(name)
    if t is None:
        raise ProtocolError(f"payload is missing tensor {name!r}")
    if t.dtype != dtype:
        raise ProtocolError(f"payload tensor {name!r} has dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ProtocolError(
            f"payload tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
        )
    if not all_finite(t):
        raise ProtocolError(f"payload tensor {name!r} contains NaN or Inf")
    return t


def meta_int(p: Payload, key: str, lo: int, hi: int) -> int:
    """The int meta field `key`, required to lie in [lo, hi]."""
    v = p.meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"payload meta {key!r} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(f"payload meta {key!r}={v} is outside [{lo}, {hi}]")
    return v


def meta_float(p: Payload, key: str) -> float:
    """The finite float meta field `key` (ints accepted)."""
    v = p.meta.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ProtocolError(f"payload meta {key!r} must be a finite number, got {v!r}")
    return float(v)


class Codec(ABC):
    """Compresses one tensor into a `Payload` and back (after hivemind's CompressionBase).

    Subclasses implement `_encode`/`_decode` on a contiguous fp32 view and declare which
    payload tensors and meta keys they use (`_layout`); `encode` and `decode` do the checks
    common to all codecs. `decode` validates everything it reads and raises only
    `ProtocolError` for a malformed payload: a sender cannot make it raise anything else or
    return a tensor of the wrong size.

    A codec is listed in `gossamer.core.codec_table` (its spec grammar and traits);
    `parse_codec` builds it with `from_arg`.

    Attributes:
        name: the codec family ("topk"); `spec` is the full canonical spec ("topk:0.01").
    """

    def release_buffers(self) -> None:
        """Drop the wire buffers kept for reuse (`WirePool`): for a caller that encodes once a round and
        would rather hold nothing between (a DiLoCo worker). Payloads still referenced stay with their holders."""
        return  # a codec without a pool holds none


    name: ClassVar[str]
    #: `_encode` itself raises ValueError on NaN/Inf, found on the way (a scale, a cast's
    #: result), so `encode` skips its own pass over the input.
    checks_finite: ClassVar[bool] = False
    #: A decode of a validated payload is finite by construction (a cast, or values bounded by
    #: a finite scale), so `decode` skips its pass over the output.
    decodes_finite: ClassVar[bool] = False

    @classmethod
    def from_arg(cls, arg: int | float | None, *, seed: int | None = None) -> Codec:
        """The codec of a spec whose argument the registry's grammar parsed as `arg`.

        Args:
            seed: seeds a stochastic codec's draws (ignored by deterministic ones).
        """
        return cls()

    @property
    def biased(self) -> bool:
        """E[decode(encode(x))] != x, so it needs error feedback to converge (the registry's say)."""
        return codec_entry(self.name).error_feedback

    @property
    def spec(self) -> str:
        """The canonical spec string; `parse_codec(c.spec)` builds an equivalent codec."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def encode(self, t: torch.Tensor, *, key: str | None = None) -> Payload:
        """Compress `t` (any shape, a floating dtype, finite values; it is not modified).

        Args:
            key: names the tensor across steps for stateful codecs (PowerSGD's warm start);
                stateless codecs ignore it.

        Raises:
            ValueError: `t` is not floating point or holds NaN/Inf.
        """
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.spec}: can only encode float tensors, got {_describe(t)}")
        x = t.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if not self.checks_finite and not all_finite(x):
            raise ValueError(f"{self.spec}: cannot encode a tensor holding NaN or Inf")
        return self._encode(x, tuple(x.shape), key)

    def decode(
        self,
        p: Payload,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rebuild a tensor of `shape` and `dtype` from `p`, validating all of it.

        Decoding computes in fp32; into fp16/bf16 the result saturates at the dtype's
        largest finite value.

        Args:
            out: a contiguous fp32 tensor of `shape`'s size to decode into (fp32 only), so a
                caller decoding often reuses one buffer instead of faulting in a new one;
                the result is then `out` reshaped to `shape`. On a ProtocolError its
                contents are unspecified.

        Raises:
            ProtocolError: `p` is malformed or does not fit `shape` (missing or extra
                tensors or meta keys, wrong dtypes or sizes, out-of-range values, NaN/Inf).
            ValueError: `shape`/`dtype` themselves are invalid (a caller bug).
        """
        shape = _check_shape(shape)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.spec}: cannot decode into {dtype}")
        if out is not None and (
            dtype != torch.float32
            or out.dtype != torch.float32
            or out.device.type != "cpu"
            or not out.is_contiguous()
            or out.numel() != math.prod(shape)
        ):
            raise ValueError(f"{self.spec}: out must be a contiguous fp32 CPU tensor of {shape}")
        if not isinstance(p, Payload):
            raise ProtocolError(f"{self.spec}: payload must be a Payload, got {_describe(p)}")
        if not isinstance(p.tensors, dict) or not isinstance(p.meta, dict):
            raise ProtocolError(f"{self.spec}: payload tensors and meta must be maps")
        for name, t in p.tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype not in WIRE_DTYPES:
                raise ProtocolError(f"{self.spec}: payload tensor {name!r} is {_describe(t)}")
        want_tensors, want_meta = self._layout(shape)
        if set(p.tensors) != want_tensors:
            raise ProtocolError(
                f"{self.spec}: payload tensors {sorted(map(str, p.tensors))} "
                f"!= expected {sorted(want_tensors)}"
            )
        if set(p.meta) != want_meta:
            raise ProtocolError(
                f"{self.spec}: payload meta keys {sorted(map(str, p.meta))} "
                f"!= expected {sorted(want_meta)}"
            )
        flat = None if out is None else out.view(-1)
        res = self._decode(p, shape, flat)
        if res.numel() != math.prod(shape):  # a bug here, never the sender's doing
            raise AssertionError(f"{self.spec} decoded {res.numel()} values for {shape}")
        if flat is not None and res.data_ptr() != flat.data_ptr():
            res = flat.copy_(res.reshape(-1))  # a codec that ignored `out`
        if not self.decodes_finite and not all_finite(res):
            raise ProtocolError(f"{self.spec}: payload decodes to values beyond the fp32 range")
        out = res.reshape(shape)
        if dtype in (torch.float16, torch.bfloat16):
            # A legitimate payload may decode a little beyond the range of the original
            # dtype (QSGD levels reach the norm, PowerSGD rounds): saturate, as fp16 does.
            top = torch.finfo(dtype).max
            out = out.clamp(-top, top)
        return out.to(dtype)

    def nominal_ratio(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        """Raw fp32 bytes over payload tensor bytes for a tensor of `shape` (default 1-D)."""
        shape = (numel,) if shape is None else _check_shape(shape)
        if math.prod(shape) != numel:
            raise ValueError(f"shape {shape} does not hold {numel} elements")
        wire = self._payload_bytes(shape)
        return 4.0 * numel / wire if wire else 1.0

    @abstractmethod
    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        """An elementwise float64 bound on |decode(encode(t)) - t| (decoding into fp32).

        For stochastic codecs it holds with probability one. Each subclass documents its
        bound; all include a little slack for fp32 round-off.
        """

    @abstractmethod
    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload: ...

    @abstractmethod
    def _decode(self, p: Payload, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        """Decode `p`, whose tensor and meta key sets already match `_layout(shape)`.

        Returns a flat or shaped fp32 tensor of the shape's size: `out` (flat fp32, written in
        place) when it is given, else a new tensor.
        """

    @abstractmethod
    def _layout(self, shape: tuple[int, ...]) -> tuple[set[str], set[str]]:
        """(payload tensor names, meta keys) of the payload for a tensor of `shape`."""

    @abstractmethod
    def _payload_bytes(self, shape: tuple[int, ...]) -> int: ...


def expect_int(arg: object) -> int:
    """`arg` as a codec's integer argument.

    Raises:
        ConfigError: it is not an int.
    """
    if not isinstance(arg, int) or isinstance(arg, bool):
        raise ConfigError("codec", f"expected an integer argument, got {arg!r}")
    return arg


def expect_float(arg: object) -> float:
    """`arg` as a codec's real-valued argument.

    Raises:
        ConfigError: it is not a number.
    """
    if not isinstance(arg, int | float) or isinstance(arg, bool):
        raise ConfigError("codec", f"expected a number argument, got {arg!r}")
    return float(arg)


def into(out: torch.Tensor | None, numel: int) -> torch.Tensor:
    """`out`, or a new uninitialised flat fp32 tensor of `numel` values."""
    return torch.empty(numel, dtype=torch.float32) if out is None else out


def fp32_slack(x: torch.Tensor) -> torch.Tensor:
    """Round-off allowance of a few fp32 operations on `x`, in float64."""
    return x.double().abs() * _F32_REL + _F32_TINY


def _check_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"bad shape {shape!r}")
    return tuple(shape)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor"
    return f"a {type(x).__name__}"
