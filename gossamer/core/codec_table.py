"""The codec registry: every codec's name, argument grammar, traits and class, importable without torch."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gossamer.core.errors import ConfigError

__all__ = [
    "ADAPTIVE",
    "CODECS",
    "CODEC_NAMES",
    "CodecEntry",
    "IntArg",
    "RatioArg",
    "codec_entry",
    "grammar",
    "parse_spec",
]

#: `compression = "adaptive"` names no codec: a policy picks one per tensor (compression/adaptive.py).
ADAPTIVE = "adaptive"

_MAX_DIGITS = 9  # ASCII digits of an integer argument: TOML, SQLite and msgpack all carry it
# A plain decimal or scientific-notation ratio (no sign, spaces, underscores, nan or inf).
_RATIO = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?")
_MAX_RATIO_CHARS = 32


@dataclass(frozen=True, kw_only=True)
class IntArg:
    """An integer argument written in ASCII digits (at most nine), `lo` <= value <= `hi`."""

    letter: str
    lo: int = 1
    hi: int = 10**_MAX_DIGITS - 1

    @property
    def rule(self) -> str:
        """What the argument must be, for errors: "L a positive integer <= 127"."""
        kind = "a positive integer" if self.lo == 1 else f"an integer >= {self.lo}"
        return f"{self.letter} {kind}" + (f" <= {self.hi}" if self.hi < 10**_MAX_DIGITS - 1 else "")

    def parse(self, text: str) -> int:
        """The value of `text`.

        Raises:
            ValueError: `text` is not such an integer.
        """
        # "²".isdigit() holds, and int("²") fails: only ASCII digits count.
        if not (text.isascii() and text.isdigit()) or len(text) > _MAX_DIGITS:
            raise ValueError(text)
        value = int(text)
        if not self.lo <= value <= self.hi:
            raise ValueError(text)
        return value


@dataclass(frozen=True, kw_only=True)
class RatioArg:
    """A ratio argument in (0, 1], written as a plain or scientific-notation decimal."""

    letter: str

    @property
    def rule(self) -> str:
        """What the argument must be, for errors: "R a ratio, 0 < R <= 1"."""
        return f"{self.letter} a ratio, 0 < {self.letter} <= 1"

    def parse(self, text: str) -> float:
        """The value of `text`.

        Raises:
            ValueError: `text` is not such a ratio.
        """
        if len(text) > _MAX_RATIO_CHARS or not _RATIO.fullmatch(text):
            raise ValueError(text)
        value = float(text)
        if not (math.isfinite(value) and 0 < value <= 1):
            raise ValueError(text)
        return value


@dataclass(frozen=True, kw_only=True)
class CodecEntry:
    """One codec: a line of the table below.

    A spec is the bare `name` when `arg` is None, else ``name:ARG`` with ARG as `arg` reads it.
    """

    #: The codec family, the spec's part before ':' (also the class's `Codec.name`).
    name: str
    #: The grammar of the spec's argument (None: the spec takes none).
    arg: IntArg | RatioArg | None = None
    #: "module:Class" of the codec (imported on first use: it needs torch).
    cls: str
    #: Its decode approximates the value itself (a dense estimate), so gossip can send
    #: parameter values with it; sparse, sign and low-rank codecs would need a reference copy
    #: of the neighbour's parameters both ends share (CHOCO-SGD), which push-sum does not keep.
    carries_values: bool = False
    #: Biased (E[decode(encode(x))] != x): gradients go through error feedback by default.
    error_feedback: bool = False
    #: Indifferent to where one parameter ends and the next begins, so adjacent parameters of a
    #: chunk share one payload. Not PowerSGD (needs the matrix), nor sign and QSGD: one scale
    #: or norm for layers whose gradients differ by orders of magnitude would swamp the small ones.
    elementwise: bool = False
    #: The experiment's `momentum` runs on the worker, before this codec (sync and async modes):
    #: a momentum the shards applied to what it decodes would act on a sign or a sparse mask
    #: and diverge (sign reached 0.383 on digits at momentum 0.9). See worker_momentum.py.
    worker_momentum: bool = False
    #: Sparse (some entries are not sent): the worker's momentum is masked where an entry was
    #: sent and the density is warmed up (DGC, Lin et al. 2018). See worker_momentum.py.
    sparse: bool = False
    #: Parameters of dim < 2 (biases, normalisation gains) whose shape the compressor knows travel
    #: uncompressed ("none") where this codec is chosen for them, as PowerSGD (Vogels et al. 2019)
    #: and DGC (Lin et al. 2018) leave them: a few thousand values that set every unit's offset or
    #: gain, where one sign scale for the whole vector hurt most (char LM, 3 async workers, momentum
    #: 0.9, 3 seeds: sign 2.387 against 2.219 for `none`, 2.199 with its vectors dense, for 1.24x
    #: the bytes). See ChunkCompressor.
    dense_vectors: bool = False
    #: Canonical specs every codec test runs on (the first is the codec's representative).
    examples: tuple[str, ...]

    @property
    def grammar(self) -> str:
        """The spec's form for docs and errors: "topk:R"."""
        return f"{self.name}:{self.arg.letter}" if self.arg is not None else self.name


_M = "gossamer.compression"

#: Every codec, in the order of the `compression` field's documentation. A new codec is its
#: module plus one line here.
CODECS: tuple[CodecEntry, ...] = (
    CodecEntry(name="none", cls=f"{_M}.float_codecs:NoneCodec", carries_values=True, elementwise=True, examples=("none",)),
    CodecEntry(name="fp16", cls=f"{_M}.float_codecs:FP16Codec", carries_values=True, elementwise=True, examples=("fp16",)),
    CodecEntry(name="bf16", cls=f"{_M}.float_codecs:BF16Codec", carries_values=True, elementwise=True, examples=("bf16",)),
    CodecEntry(name="int8", cls=f"{_M}.quantization:Int8Codec", carries_values=True, error_feedback=True, elementwise=True, examples=("int8",)),
    CodecEntry(name="qsgd", arg=IntArg(letter="L", hi=127), cls=f"{_M}.quantization:QSGDCodec", carries_values=True, examples=("qsgd:4", "qsgd:127")),
    CodecEntry(name="topk", arg=RatioArg(letter="R"), cls=f"{_M}.sparsification:TopKCodec", error_feedback=True, elementwise=True, worker_momentum=True, sparse=True, examples=("topk:0.1", "topk:1")),
    CodecEntry(name="powersgd", arg=IntArg(letter="K"), cls=f"{_M}.powersgd:PowerSGDCodec", error_feedback=True, examples=("powersgd:2",)),
    CodecEntry(name="sign", cls=f"{_M}.sign:SignCodec", error_feedback=True, worker_momentum=True, dense_vectors=True, examples=("sign",)),
    CodecEntry(name="randk", arg=RatioArg(letter="R"), cls=f"{_M}.randk:RandKCodec", error_feedback=True, elementwise=True, worker_momentum=True, sparse=True, examples=("randk:0.1", "randk:1.0")),
)

#: Codec families, in table order.
CODEC_NAMES: tuple[str, ...] = tuple(e.name for e in CODECS)
_BY_NAME = {e.name: e for e in CODECS}


def codec_entry(name: str) -> CodecEntry:
    """The entry of codec family `name`.

    Raises:
        KeyError: no such codec.
    """
    return _BY_NAME[name]


def grammar(*, values_only: bool = False, sep: str = "|") -> str:
    """The accepted spec forms, "none|fp16|...|topk:R|...", for docs and errors.

    Args:
        values_only: only codecs that can carry parameter values (gossip).
    """
    return sep.join(e.grammar for e in CODECS if e.carries_values or not values_only)


def parse_spec(spec: object, *, field: str = "compression") -> tuple[CodecEntry, int | float | None]:
    """The entry and parsed argument of a spec, exactly as written (no spaces are stripped).

    Raises:
        ConfigError: naming `field`, when `spec` is not a codec spec of the grammar.
    """
    if not isinstance(spec, str):
        raise ConfigError(field, f"codec spec must be a string, got {type(spec).__name__}")
    name, sep, text = spec.partition(":")
    entry = _BY_NAME.get(name)
    if entry is None:
        raise ConfigError(field, f"unknown codec {spec!r}; expected {grammar()}")
    if entry.arg is None:
        if sep:
            raise ConfigError(field, f"{spec!r}: {name} takes no argument")
        return entry, None
    try:
        if not sep:
            raise ValueError(spec)
        return entry, entry.arg.parse(text)
    except ValueError:
        raise ConfigError(field, f"{spec!r}: expected {entry.grammar} with {entry.arg.rule}") from None
