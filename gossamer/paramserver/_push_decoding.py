"""A push's tensors as dense chunk gradients, and parts added up: one code path for a primary and its backup."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import ConfigError, ProtocolError
from gossamer.core.protocol import PushCompression, parse_chunk_key
from gossamer.paramserver._reject import Reject
from gossamer.paramserver._state import ShardState
from gossamer.transport.router import NOT_FOUND

__all__ = ["EncodedPart", "PushDecoders", "accumulate"]

_MAX_DECODERS = 64  # an adaptive sender changes codecs; the cache of decoders stays bounded


@dataclass(frozen=True)
class EncodedPart:
    """A compressed push as it arrived: what a backup needs to decode it exactly as the primary did."""

    compression: PushCompression
    #: The push's payload tensors, by their PUSH names ("c3/0/values").
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def accumulate(total: dict[int, torch.Tensor], grads: Mapping[int, torch.Tensor]) -> None:
    """Add one part's chunk gradients into `total`, in place.

    A chunk's first gradient becomes its sum's buffer (a received frame or a decoded tensor,
    never read again: no copy of the shard); later ones are added to it. Parts of one worker's
    update cover disjoint chunks, so for them this is a union. The order of the calls fixes the
    floating-point result: a backup adding the same parts in the same order gets the same bits.
    """
    for idx, g in grads.items():
        if idx in total:
            total[idx].add_(g)
        else:
            total[idx] = g


class PushDecoders:
    """Validates a push's tensors and decodes compressed ones, with a bounded cache of decoders.

    The primary runs it on every PUSH; its backup on the pushes the primary forwards encoded,
    so both apply the same decoded gradient (codec decoders are stateless: same payload, same bits).
    """

    def __init__(self, state: ShardState) -> None:
        self.state = state
        self._decoders: dict[tuple[str, tuple[tuple[str, str], ...]], ChunkCompressor] = {}

    @property
    def decode_seconds(self) -> float:
        """Time spent decompressing (all codecs)."""
        return sum(d.decode_seconds for d in self._decoders.values())

    def dense(self, tensors: Mapping[str, torch.Tensor], op: str, per_chunk: int = 1) -> dict[int, torch.Tensor]:
        """Uncompressed chunk gradients ("c3": fp32 of `per_chunk` times the chunk's size) by chunk index."""
        grads: dict[int, torch.Tensor] = {}
        for name, t in tensors.items():
            idx = parse_chunk_key(name)
            c = self.state.chunks.get(idx)
            if c is None:
                raise Reject(f"chunk {idx} is not on shard {self.state.config.shard}", NOT_FOUND)
            if t.dtype != torch.float32:
                raise Reject(f"{op} gradient {name!r} must be float32, got {t.dtype}")
            if tuple(t.shape) != (per_chunk * c.numel,):
                raise Reject(f"{op} gradient {name!r} must have shape [{per_chunk * c.numel}], got {list(t.shape)}")
            grads[idx] = t
        return grads

    def decode(self, part: EncodedPart) -> dict[int, torch.Tensor]:
        """The dense, finite chunk gradients of a compressed push (Reject or ProtocolError if malformed)."""
        grads: dict[int, torch.Tensor] = {}
        self.decode_into(grads, part)
        return grads

    def decode_into(self, total: dict[int, torch.Tensor] | None, part: EncodedPart,
                    only: Collection[int] | None = None) -> list[int]:
        """Decode a compressed push chunk by chunk, each added into `total` as `accumulate` does
        (None: only checked, nothing kept); returns the chunks it covers. `only`: decode those of its
        chunks alone (a step taken a group of chunks at a time, `ShardState.step`).

        One chunk's decoded copy is alive at a time (not the part's whole dense gradient beside
        the sum); per element the additions are the same, so the bits are those of `decode` then
        `accumulate`. On a Reject or ProtocolError `total` is left partly added: discard it.
        """
        decoder = self._decoder(part.compression)
        indices: list[tuple[int, object]] = []
        for key, meta in part.compression.chunks.items():
            if not isinstance(key, str) or not key.isdigit() or len(key) > 9:
                raise Reject(f"compressed chunk key {key!r} is not a chunk index")
            idx = int(key)
            if idx not in self.state.chunks:
                raise Reject(f"chunk {idx} is not on shard {self.state.config.shard}", NOT_FOUND)
            indices.append((idx, meta))
        stray = {n.split("/", 1)[0] for n in part.tensors} - {f"c{i}" for i, _ in indices}
        if stray:
            raise Reject(f"tensors {sorted(stray)[:4]} belong to no declared compressed chunk")
        for idx, meta in indices:
            if only is not None and idx not in only:
                continue
            g = decoder.decode(idx, part.tensors, meta)
            if not bool(torch.isfinite(g).all()):
                raise Reject(f"chunk {idx}: decoded gradient is not finite")
            if total is not None:
                accumulate(total, {idx: g})
        return [idx for idx, _ in indices]

    def forwarded(self, parts: tuple[PushCompression, ...],
                  tensors: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The gradient of an encoded REPLICATE: each forwarded push decoded and added up in order, as
        the primary did (`decode`, `accumulate`), chunk by chunk into the sum (`decode_into`): one
        chunk's decoded copy beside it, not a part's whole dense gradient. It empties `tensors` (the
        message's): each part's payload is dropped once decoded, freed where nothing else holds it.

        Everything checkable from the header is checked before any part is decoded (tensor names,
        parts that carry nothing, chunk coverage, a payload no smaller than the dense gradient the
        primary would have sent instead), so a malformed forward costs no decoding; each part's
        sizes are then checked against the plan by the codecs before anything is allocated.
        """
        split = self._split_forwarded(parts, tensors)
        grads: dict[int, torch.Tensor] = {}
        for n, part in enumerate(parts):
            encoded, split[n] = EncodedPart(part, split[n]), {}
            self._decode_forwarded(n, grads, encoded)
            del encoded
        return grads

    def forwarded_parts(self, parts: tuple[PushCompression, ...],
                        tensors: dict[str, torch.Tensor]) -> list[EncodedPart]:
        """The pushes of an encoded REPLICATE, each checked (`forwarded`'s checks, then decoded chunk by chunk
        with nothing kept), to be decoded again a group of chunks at a time into the step (`ShardState.step`
        with a function of the chunks): the dense sum is never whole. It empties `tensors`; the parts hold the
        payload until the step is taken."""
        out = [EncodedPart(part, t) for part, t in zip(parts, self._split_forwarded(parts, tensors), strict=True)]
        for n, encoded in enumerate(out):
            self._decode_forwarded(n, None, encoded)
        return out

    def _split_forwarded(self, parts: tuple[PushCompression, ...],
                         tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """An encoded REPLICATE's tensors by forwarded push, checked from the header (`forwarded`); empties
        `tensors`."""
        split: list[dict[str, torch.Tensor]] = [{} for _ in parts]
        for name in tensors:
            head, sep, rest = name.partition("/")
            k = head[1:]
            if not sep or head[:1] != "p" or not k.isdigit() or len(k) > 6 or int(k) >= len(parts):
                raise Reject(f"REPLICATE tensor {name!r} belongs to none of its {len(parts)} forwarded pushes")
            split[int(k)][rest] = tensors[name]
        if empty := [k for k, part_tensors in enumerate(split) if not part_tensors]:
            raise Reject(f"REPLICATE meta 'parts' declares {len(parts)} pushes but parts {empty[:4]} carry no "
                         "tensors")
        covered = Counter(key for part in parts for key in part.chunks)
        shard = {str(idx) for idx in self.state.chunks}
        if set(covered) != shard or len(set(covered.values())) != 1:
            raise Reject(f"REPLICATE meta 'parts' must cover every chunk of the shard ({len(shard)}), each as "
                         f"often as the others; they cover {dict(sorted(covered.items(), key=str)[:8])}")
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        dense = 4 * sum(c.numel for c in self.state.chunks.values())
        if payload >= dense:
            raise Reject(f"REPLICATE's forwarded pushes carry {payload} B, not less than the {dense} B dense "
                         "gradient the primary sends instead")
        tensors.clear()
        return split

    def summed(self, parts: list[EncodedPart], chunks: Collection[int]) -> dict[int, torch.Tensor]:
        """The sum of `parts` over `chunks` alone, decoded and added in their order (the bits of the whole sum's)."""
        total: dict[int, torch.Tensor] = {}
        for part in parts:
            self.decode_into(total, part, chunks)
        return total

    def _decode_forwarded(self, n: int, total: dict[int, torch.Tensor] | None, encoded: EncodedPart) -> None:
        try:
            self.decode_into(total, encoded)
        except ProtocolError as e:
            raise Reject(f"REPLICATE forwarded push {n}: {e}") from None
        except Reject as e:
            raise Reject(f"REPLICATE forwarded push {n}: {e}", e.code, e.cause) from None

    def _decoder(self, compression: PushCompression) -> ChunkCompressor:
        key = (compression.codec, compression.overrides)
        decoder = self._decoders.get(key)
        if decoder is None:
            try:
                decoder = ChunkCompressor(compression.codec, self.state.plan, overrides=list(compression.overrides),
                                          shapes=self.state.shapes)
            except ConfigError as e:
                raise Reject(f"cannot decode: {e}") from None
            if len(self._decoders) >= _MAX_DECODERS:
                self._decoders.pop(next(iter(self._decoders)))
            self._decoders[key] = decoder
        return decoder
