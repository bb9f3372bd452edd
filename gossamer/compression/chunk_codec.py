"""Compress and decompress one shard-plan chunk, codec by codec for each parameter inside it."""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gossamer.compression.codec import Codec, Payload
from gossamer.compression.codec_spec import parse_codec
from gossamer.compression.error_feedback import ErrorFeedback
from gossamer.compression.wire_pool import WirePool
from gossamer.compression.worker_momentum import WorkerMomentum
from gossamer.core.codec_table import codec_entry
from gossamer.core.errors import ConfigError, ProtocolError

if TYPE_CHECKING:  # the data plane imports this module: no import cycle at run time
    from gossamer.engine.shard_plan import ShardPlan

__all__ = ["CHUNK_META_VERSION", "ChunkCompressor", "Segment"]


CHUNK_META_VERSION = 1
_CHUNK_META_KEYS = {"v", "chunk", "numel", "segments"}
_SEGMENT_META_KEYS = {"param", "offset", "numel", "codec", "meta"}


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that lies inside a chunk.

    `param_offset` is where it starts inside the parameter, `chunk_offset` inside the chunk;
    `shape` is the parameter's real shape when the segment covers all of it and the caller
    gave it, else ``(numel,)``.
    """

    param: str
    param_offset: int
    chunk_offset: int
    numel: int
    shape: tuple[int, ...]
    codec: str


class ChunkCompressor:
    """Encodes chunks of the flat gradient (workers) and decodes them (shards).

    Each chunk is cut into `Segment`s, one per parameter it touches, and every segment is
    compressed on its own by the codec its parameter maps to, so a codec never mixes two
    parameters (PowerSGD sees real matrices, top-k ranks within one tensor).

    Wire format of chunk ``i`` (`encode`'s result; `decode` takes the same): tensors named
    ``c{i}/{s}/{part}`` -- ``s`` the segment's position in the chunk, ``part`` the codec's
    payload tensor ("values", "indices", "p", ...) -- and one msgpack-safe meta map::

        {"v": 1, "chunk": i, "numel": chunk numel,
         "segments": [{"param": name, "offset": param_offset, "numel": n,
                       "codec": canonical spec, "meta": payload meta}, ...]}

    The decoder checks every field against its own plan and codec choice (a worker whose
    codec differs from the shard's is refused with a ProtocolError naming both), so
    encoder and decoder only share the constructor arguments; PowerSGD's warm-start state
    stays in the encoder, its payload being self-contained.

    Adjacent segments with the same elementwise codec (`CodecEntry.elementwise`: none, fp16,
    bf16, int8, topk, ...) are merged into one 1-D segment, so a chunk of many small
    parameters costs one payload, not one each; sign, QSGD and PowerSGD keep one segment per
    parameter.

    A parameter of dim < 2 (a bias, a normalisation gain) whose shape is in `shapes` travels
    uncompressed ("none") when the codec chosen for it says `CodecEntry.dense_vectors` (sign), as
    PowerSGD and DGC leave such tensors; the shards hold the shapes too, so both ends agree.

    Error feedback runs per chunk (key ``c{i}``) in the encoder, on the segments whose codec
    uses it: the residual is added before encoding and what decoding lost becomes the next
    residual. Keyed by chunk, it survives a change of codecs that re-cuts the segments. A caller
    may fold a chunk's residual into its own input (`feedback.take`, then `folded`): that input is
    used as compensated and the new residual kept in its buffer, in place. `take_back` undoes the
    residual update of a push refused whole, from its payload recorded in `recorded`.

    Counters (both directions add to them, an instance normally doing one): `raw_bytes`
    (fp32 bytes of the chunks), `wire_bytes` (payload tensor bytes; the meta is not
    counted), `encode_seconds`, `decode_seconds`. Not thread-safe.

    Args:
        spec: the default codec spec (see `parse_codec`).
        plan: the shard plan the chunk indices refer to.
        error_feedback: True/False for every segment; None: on for biased codecs
            (`Codec.biased`) only.
        overrides: (fnmatch pattern on the parameter name, codec spec) pairs; the first
            matching pattern wins, else `spec`.
        shapes: real shapes of parameters by name, so a whole-parameter segment keeps its
            matrix shape (PowerSGD needs it); others are 1-D.
        seed: seeds QSGD's draws and PowerSGD's initial Q.
        momentum: the worker's momentum, applied to each chunk before error feedback and the
            codec (`WorkerMomentum`); masked where a sparse codec sent an entry (DGC).
        unbiased_random: random-k segments are sent as an unbiased sample, multiplied by
            numel / k, with neither error feedback nor momentum masking. With the momentum on
            the worker this is momentum SGD in expectation; error feedback instead delivers
            each entry's accumulation in bursts every ~1/R steps, a delayed gradient that
            diverged with momentum 0.9 (digits MLP randk:0.1, 3 async workers, in-process
            simulation: 0.51 with masking, 0.11 without; unbiased: 0.98, none 0.98).

    Raises:
        ConfigError: a bad spec (field "compression" or "overrides") or a shape whose size
            differs from the plan's (field "shapes").
    """

    def __init__(
        self,
        spec: str,
        plan: ShardPlan,
        *,
        error_feedback: bool | None = None,
        overrides: Sequence[tuple[str, str]] = (),
        shapes: Mapping[str, Sequence[int]] | None = None,
        seed: int | None = None,
        momentum: WorkerMomentum | None = None,
        unbiased_random: bool = False,
    ) -> None:
        self.plan = plan
        self.momentum = momentum
        self.unbiased_random = unbiased_random
        self._error_feedback = error_feedback
        self._seed = seed
        self._codecs: dict[str, Codec] = {}
        self.default_spec = self._codec(spec, "compression").spec
        self.overrides: list[tuple[str, str]] = []
        for item in overrides:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ConfigError("overrides", f"expected (pattern, codec) pairs, got {item!r}")
            pattern, override = item
            if not isinstance(pattern, str):
                raise ConfigError("overrides", f"pattern must be a string, got {pattern!r}")
            self.overrides.append((pattern, self._codec(override, "overrides").spec))
        numels = dict(plan.params)
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in (shapes or {}).items():
            if name not in numels:
                raise ConfigError("shapes", f"{name!r} is not a parameter of the plan")
            dims = tuple(int(d) for d in shape)
            if math.prod(dims) != numels[name] or any(d < 0 for d in dims):
                raise ConfigError(
                    "shapes", f"{name!r} has {numels[name]} elements, not shape {list(dims)}"
                )
            self._shapes[name] = dims
        # Vectors whose codec keeps them dense (`codec_of`); "none" is then one of the codecs.
        self._vectors = {name for name, dims in self._shapes.items() if len(dims) < 2}
        if self._vectors:
            self._codec("none", "compression")
        self._starts: list[tuple[str, int, int]] = []  # (name, flat start, numel), non-empty
        total = 0
        for name, numel in plan.params:
            if numel:
                self._starts.append((name, total, numel))
            total += numel
        self._segments: dict[int, tuple[Segment, ...]] = {}
        self.feedback = ErrorFeedback()
        #: What decoding gave back, per chunk size, reused: a fresh chunk is faulted in page by page.
        self._kept = WirePool(per_key=1)
        #: Chunks whose next `encode` input already holds their residual (taken out with `feedback.take`) and
        #: is handed over: the new residual is kept in it, in place (DiLoCo's round start, `RoundStart`).
        self.folded: set[int] = set()
        #: While a dict: each chunk's last wire tensors and meta, by index (`take_back` needs them).
        self.recorded: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] | None = None
        self.raw_bytes = 0
        self.wire_bytes = 0
        self.encode_seconds = 0.0
        self.decode_seconds = 0.0

    @property
    def seed(self) -> int | None:
        """The seed the codecs were built with."""
        return self._seed

    @property
    def error_feedback(self) -> bool | None:
        """The `error_feedback` this compressor was built with (None: on for biased codecs)."""
        return self._error_feedback

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The parameter shapes this compressor was given."""
        return dict(self._shapes)

    def _codec(self, spec: str, field: str) -> Codec:
        codec = parse_codec(spec, seed=self._seed, field=field)
        return self._codecs.setdefault(codec.spec, codec)

    def _elementwise(self, spec: str) -> bool:
        return codec_entry(self._codecs[spec].name).elementwise

    def codec_of(self, param: str) -> str:
        """The canonical codec spec used for parameter `param` ("none" for a vector its codec keeps dense)."""
        spec = next((s for pattern, s in self.overrides if fnmatch.fnmatchcase(param, pattern)), self.default_spec)
        if param in self._vectors and codec_entry(self._codecs[spec].name).dense_vectors:
            return "none"
        return spec

    def codecs(self) -> dict[str, str]:
        """The codec spec of every parameter of the plan, in plan order."""
        return {name: self.codec_of(name) for name, _ in self.plan.params}

    def _unbiased(self, spec: str) -> bool:
        return self.unbiased_random and hasattr(self._codecs[spec], "unbiased_scale")

    def uses_error_feedback(self, param: str) -> bool:
        if self._unbiased(self.codec_of(param)):
            return False
        if self._error_feedback is not None:
            return self._error_feedback
        return self._codecs[self.codec_of(param)].biased

    def feeds_back(self, chunk_index: int) -> bool | None:
        """Whether error feedback runs on every segment of a chunk (True), on none (False), or on some (None)."""
        uses = {self.uses_error_feedback(seg.param) for seg in self.segments(chunk_index)}
        return None if len(uses) > 1 else uses == {True}

    def segments(self, chunk_index: int) -> tuple[Segment, ...]:
        """The parameter segments of a chunk, in order.

        Raises:
            ProtocolError: `chunk_index` is not a chunk of the plan.
        """
        cached = self._segments.get(chunk_index)
        if cached is not None:
            return cached
        if (
            not isinstance(chunk_index, int)
            or isinstance(chunk_index, bool)
            or not 0 <= chunk_index < len(self.plan.chunks)
        ):
            raise ProtocolError(f"chunk {chunk_index!r} is not in the plan")
        c = self.plan.chunks[chunk_index]
        lo, hi = c.flat_offset, c.flat_offset + c.numel
        segs: list[Segment] = []
        for name, start, numel in self._starts:
            a, b = max(lo, start), min(hi, start + numel)
            if a >= b:
                continue
            whole = b - a == numel
            shape = self._shapes.get(name, (numel,)) if whole else (b - a,)
            full = self._shapes.get(name)
            if not whole and full is not None and len(full) >= 2:
                row = math.prod(full[1:])
                if row and (a - start) % row == 0 and (b - a) % row == 0:
                    shape = ((b - a) // row, *full[1:])  # whole rows of a matrix stay a matrix
            seg = Segment(name, a - start, a - lo, b - a, shape, self.codec_of(name))
            prev = segs[-1] if segs else None
            if prev is not None and prev.codec == seg.codec and self._elementwise(seg.codec):
                # Elementwise codecs do not care where a parameter ends: one segment (and so
                # one payload) for the run saves a header entry per parameter.
                segs[-1] = Segment(
                    prev.param,
                    prev.param_offset,
                    prev.chunk_offset,
                    prev.numel + seg.numel,
                    (prev.numel + seg.numel,),
                    seg.codec,
                )
            else:
                segs.append(seg)
        self._segments[chunk_index] = result = tuple(segs)
        return result

    def encode(
        self, chunk_index: int, flat_values: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Compress the values (a gradient or delta) of chunk `chunk_index`.

        Args:
            flat_values: the chunk's `numel` values (any float dtype, finite); not modified.

        Returns:
            (wire tensors by name, meta), the format in the class docstring.

        Raises:
            ValueError: `flat_values` has the wrong size, dtype or non-finite values.
            ProtocolError: `chunk_index` is not in the plan.
        """
        t0 = time.perf_counter()
        segs = self.segments(chunk_index)
        numel = self.plan.chunks[chunk_index].numel
        if not isinstance(flat_values, torch.Tensor) or flat_values.numel() != numel:
            raise ValueError(f"chunk {chunk_index} has {numel} values, got {flat_values!r:.80}")
        x = flat_values.detach().reshape(-1).to(torch.float32)
        # Error feedback runs on the whole chunk (key "c{i}"), so the memory survives a
        # change of codecs (adaptive) that re-cuts the chunk's segments.
        key = f"c{chunk_index}"
        if self.momentum is not None:
            x = self.momentum.step(key, x)
        sent: torch.Tensor | None = None
        feedback = any(self.uses_error_feedback(seg.param) for seg in segs)
        handed = chunk_index in self.folded and feedback and self.momentum is None
        self.folded.discard(chunk_index)
        in_residual = False  # compensated in the residual's own buffer, which then takes the new residual
        if feedback:
            if not handed:
                summed = self.feedback.compensate_in_place(key, x)
                in_residual = summed is not None
                x = summed if summed is not None else self.feedback.compensate(key, x)
            kept = self._kept.take(f"kept:{numel}", torch.float32, numel)
        tensors: dict[str, torch.Tensor] = {}
        seg_meta: list[dict[str, Any]] = []
        for s, seg in enumerate(segs):
            codec = self._codecs[seg.codec]
            lo, hi = seg.chunk_offset, seg.chunk_offset + seg.numel
            v = x[lo:hi].reshape(seg.shape)
            unbiased = self._unbiased(seg.codec)
            if unbiased:
                v = v * codec.unbiased_scale(seg.numel)  # type: ignore[attr-defined]
            payload = codec.encode(v, key=f"{seg.param}@{seg.param_offset}")
            decoded: torch.Tensor | None = None
            if feedback:
                if self.uses_error_feedback(seg.param):
                    codec.decode(payload, seg.shape, torch.float32, out=kept[lo:hi])
                    decoded = kept[lo:hi]
                else:
                    kept[lo:hi] = x[lo:hi]  # no feedback here: nothing is carried over
            if self.momentum is not None and codec_entry(codec.name).sparse and not unbiased:
                if sent is None:
                    sent = torch.zeros(numel, dtype=torch.bool)
                if decoded is None:
                    decoded = codec.decode(payload, seg.shape, torch.float32).reshape(-1)
                sent[lo:hi] = decoded != 0  # an entry sent as an exact 0 keeps its velocity
            for part, t in payload.tensors.items():
                tensors[f"{key}/{s}/{part}"] = t
            seg_meta.append(
                {
                    "param": seg.param,
                    "offset": seg.param_offset,
                    "numel": seg.numel,
                    "codec": seg.codec,
                    "meta": dict(payload.meta),
                }
            )
        if feedback:
            ours = x.untyped_storage().data_ptr()
            if (handed or in_residual) and all(t.untyped_storage().data_ptr() != ours for t in tensors.values()):
                self.feedback.keep(key, x.sub_(kept))  # in the buffer handed over: no new residual
            else:
                self.feedback.update(key, x, kept)
        if self.momentum is not None and sent is not None:
            self.momentum.mask(key, sent)
        meta = {"v": CHUNK_META_VERSION, "chunk": chunk_index, "numel": numel, "segments": seg_meta}
        if self.recorded is not None:
            self.recorded[chunk_index] = (tensors, meta)
        self.raw_bytes += 4 * numel
        self.wire_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.encode_seconds += time.perf_counter() - t0
        return tensors, meta

    def decode(
        self, chunk_index: int, tensors: Mapping[str, torch.Tensor], meta: Any
    ) -> torch.Tensor:
        """Rebuild chunk `chunk_index` as an fp32 tensor of shape (numel,).

        Args:
            tensors: the received tensors; those named ``c{chunk_index}/...`` are this
                chunk's (others, e.g. other chunks of the same message, are ignored).
            meta: the meta map `encode` returned.

        Raises:
            ProtocolError: anything malformed or inconsistent with the plan and codecs.
        """
        t0 = time.perf_counter()
        segs = self.segments(chunk_index)
        numel = self.plan.chunks[chunk_index].numel
        if not isinstance(tensors, Mapping):
            raise ProtocolError(f"chunk {chunk_index}: tensors must be a map")
        self._check_chunk_meta(chunk_index, numel, len(segs), meta)
        prefix = f"c{chunk_index}/"
        parts: list[dict[str, torch.Tensor]] = [{} for _ in segs]
        wire = 0
        for name, t in tensors.items():
            if not isinstance(name, str) or not name.startswith(prefix):
                continue
            s_str, sep, part = name[len(prefix) :].partition("/")
            if not sep or not s_str.isdigit() or len(s_str) > 6 or int(s_str) >= len(segs):
                raise ProtocolError(f"chunk {chunk_index}: unexpected tensor {name!r}")
            parts[int(s_str)][part] = t
            if isinstance(t, torch.Tensor):
                wire += t.numel() * t.element_size()
        out = torch.empty(numel, dtype=torch.float32)
        for s, seg in enumerate(segs):
            m = meta["segments"][s]
            where = f"chunk {chunk_index} segment {s} ({seg.param})"
            if m["codec"] != seg.codec:
                raise ProtocolError(
                    f"{where}: sender used codec {m['codec']!r}, this side expects {seg.codec!r}"
                )
            if (
                m["param"] != seg.param
                or m["offset"] != seg.param_offset
                or m["numel"] != seg.numel
            ):
                raise ProtocolError(
                    f"{where}: meta says {m['param']!r}[{m['offset']!r}:+{m['numel']!r}], "
                    f"the plan says {seg.param!r}[{seg.param_offset}:+{seg.numel}]"
                )
            try:
                self._codecs[seg.codec].decode(
                    Payload(parts[s], m["meta"]),
                    seg.shape,
                    torch.float32,
                    out=out[seg.chunk_offset : seg.chunk_offset + seg.numel],
                )
            except ProtocolError as e:
                raise ProtocolError(f"{where}: {e}") from None
        self.raw_bytes += 4 * numel
        self.wire_bytes += wire
        self.decode_seconds += time.perf_counter() - t0
        return out

    def take_back(self, chunk_index: int, pushed: torch.Tensor | None) -> torch.Tensor | None:
        """Undo the residual update of chunk `chunk_index`'s last `encode` (recorded in `recorded`): its push was
        refused whole, so nothing it carried arrived. `pushed`: what that encode was given, the residual goes back
        to what it was before it; None: it was handed over (`folded`): its value, the compensated input, is
        rebuilt in the residual's buffer, removed and returned. None where the chunk has no residual.
        """
        assert self.recorded is not None, "take_back needs the encodes recorded in `recorded`"
        tensors, meta = self.recorded.pop(chunk_index)
        key = f"c{chunk_index}"
        r = self.feedback.residual(key)
        if r is None:
            return None
        decoded = self.decode(chunk_index, tensors, meta)  # what the refused push carried
        for seg in self.segments(chunk_index):
            if self.uses_error_feedback(seg.param):
                part = slice(seg.chunk_offset, seg.chunk_offset + seg.numel)
                r[part].add_(decoded[part])  # compensated - decoded + decoded: the compensated input
                if pushed is not None:
                    r[part].sub_(pushed.reshape(-1)[part].to(r.device, r.dtype))
        return self.feedback.take(key) if pushed is None else None

    @staticmethod
    def _check_chunk_meta(chunk_index: int, numel: int, nsegs: int, meta: Any) -> None:
        where = f"chunk {chunk_index}"
        if not isinstance(meta, dict) or set(meta) != _CHUNK_META_KEYS:
            keys = sorted(map(str, meta)) if isinstance(meta, dict) else type(meta).__name__
            raise ProtocolError(
                f"{where}: meta must be a map with keys {sorted(_CHUNK_META_KEYS)}, got {keys}"
            )
        if type(meta["v"]) is not int or meta["v"] != CHUNK_META_VERSION:
            raise ProtocolError(f"{where}: unsupported chunk meta version {meta['v']!r}")
        if type(meta["chunk"]) is not int or meta["chunk"] != chunk_index:
            raise ProtocolError(f"{where}: meta names chunk {meta['chunk']!r}")
        if type(meta["numel"]) is not int or meta["numel"] != numel:
            raise ProtocolError(f"{where}: meta says {meta['numel']!r} values, the plan {numel}")
        segments = meta["segments"]
        if not isinstance(segments, list) or len(segments) != nsegs:
            got = len(segments) if isinstance(segments, list) else type(segments).__name__
            raise ProtocolError(f"{where}: expected {nsegs} segments in meta, got {got}")
        for s, m in enumerate(segments):
            if not isinstance(m, dict) or set(m) != _SEGMENT_META_KEYS:
                raise ProtocolError(
                    f"{where}: segment {s} meta must be a map with keys {sorted(_SEGMENT_META_KEYS)}"
                )
            for key, kind in (("param", str), ("offset", int), ("numel", int), ("codec", str)):
                if type(m[key]) is not kind:
                    raise ProtocolError(
                        f"{where}: segment {s} meta {key!r} must be {kind.__name__}"
                    )
            if not isinstance(m["meta"], dict):
                raise ProtocolError(f"{where}: segment {s} payload meta must be a map")

    def release_buffers(self) -> None:
        """Drop every codec's wire buffers kept for reuse (`Codec.release_buffers`)."""
        for codec in self._codecs.values():
            codec.release_buffers()

    def reset(self) -> None:
        """Forget error-feedback residuals and PowerSGD warm starts (e.g. after a rejoin)."""
        self.feedback.reset()
        self.folded.clear()
        if self.momentum is not None:
            self.momentum.reset()
        for codec in self._codecs.values():
            reset = getattr(codec, "reset", None)
            if reset is not None:
                reset()
