"""How the flat fp32 parameter vector is cut into chunks and placed on shards and local ranks."""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossamer.core.errors import ConfigError

__all__ = ["FSDP_MAX_LOCAL_RANKS", "Chunk", "ShardPlan", "flatten_grads", "flatten_params", "fsdp_row_cuts",
           "take_shard_values", "unflatten_into"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_NUMEL = 1 << 20

# The parameter-server plan of an fsdp experiment is cut wherever FSDP2 cuts a parameter for
# any local world size up to this, so every rank of any node exchanges whole chunks.
FSDP_MAX_LOCAL_RANKS = 8


def fsdp_row_cuts(rows: int, max_world: int = FSDP_MAX_LOCAL_RANKS) -> set[int]:
    """Row indices where FSDP2's dim-0 split (torch.chunk) cuts `rows` rows for worlds 2..max_world."""
    cuts: set[int] = set()
    for world in range(2, max_world + 1):
        step = -(-rows // world)
        cuts.update(range(step, rows, step))
    return cuts


@dataclass(frozen=True)
class Chunk:
    """A contiguous range of the flat parameter vector; it may span several parameters.

    `flat_offset` is the offset in the concatenation of all parameters in
    `named_parameters()` order; `name` and `param_offset` say where the chunk starts (which
    parameter, and the offset inside it).
    """

    index: int
    name: str
    param_offset: int
    flat_offset: int
    numel: int
    shard: int


def chunk_groups(indices: Iterable[int], chunks: Sequence[Chunk] | Mapping[int, Chunk], budget: int) -> list[list[int]]:
    """`indices` in order, cut into groups of at most `budget` bytes of fp32 values (at least one chunk each).

    A shard steps, and a worker pulls, a large model a group at a time: one group's temporaries at once.
    """
    groups: list[list[int]] = []
    size = budget
    for i in indices:
        nbytes = 4 * chunks[i].numel
        if size + nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def _greedy(chunks: Iterable[Chunk], bins: int) -> dict[int, int]:
    """Largest chunk first onto the least-loaded bin; ties go to the lower chunk/bin index."""
    heap = [(0, b) for b in range(bins)]
    placement: dict[int, int] = {}
    for c in sorted(chunks, key=lambda c: (-c.numel, c.index)):
        load, b = heapq.heappop(heap)
        placement[c.index] = b
        heapq.heappush(heap, (load + c.numel, b))
    return placement


@dataclass(frozen=True)
class ShardPlan:
    """The chunking and shard placement of a model's parameters (JSON-safe via `to_dict`)."""

    params: tuple[tuple[str, int], ...]
    num_shards: int
    chunk_numel: int
    chunks: tuple[Chunk, ...]

    @classmethod
    def build(
        cls,
        named_numels: list[tuple[str, int]],
        num_shards: int,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        row_numels: dict[str, int] | None = None,
        cuts: Iterable[int] | None = None,
    ) -> ShardPlan:
        """Cut the flat vector into near-equal chunks of at most `chunk_numel`, place them greedily.

        With `cuts` (flat offsets), every parameter boundary and every given offset is a
        chunk boundary instead (see `for_module`'s `align`), and longer stretches are cut
        into near-equal row-aligned chunks of at most `chunk_numel`.

        Each cut moves to a parameter boundary when one is within a quarter chunk, else to a
        row boundary of the parameter it falls in (`row_numels`: elements per row, i.e.
        per index of dim 0), so codecs such as PowerSGD still see whole rows of a matrix.

        Raises:
            ConfigError: on a non-positive `num_shards`/`chunk_numel`, a negative size or a
                duplicate parameter name.
        """
        if not isinstance(num_shards, int) or num_shards <= 0:
            raise ConfigError("num_shards", f"must be a positive int, got {num_shards!r}")
        if not isinstance(chunk_numel, int) or chunk_numel <= 0:
            raise ConfigError("chunk_numel", f"must be a positive int, got {chunk_numel!r}")
        seen: set[str] = set()
        starts: list[tuple[int, str]] = []  # (flat offset, parameter name) of non-empty params
        total = 0
        for name, numel in named_numels:
            if name in seen:
                raise ConfigError("named_numels", f"duplicate parameter {name!r}")
            if not isinstance(numel, int) or numel < 0:
                raise ConfigError("named_numels", f"{name!r} has bad numel {numel!r}")
            seen.add(name)
            if numel:
                starts.append((total, name))
            total += numel
        if cuts is not None:
            return cls._build_at_cuts(named_numels, num_shards, chunk_numel, rows_of=row_numels or {},
                                      starts=starts, total=total, cuts=cuts)
        # Near-equal contiguous ranges, as few as the size limit allows but at least one per
        # shard: small parameters are packed together, so a small model costs one frame per
        # shard (per-tensor costs dominate small messages); elementwise optimizers do not care
        # where a chunk starts, and row-aligned cuts keep matrices for PowerSGD.
        count = min(total, max(-(-total // chunk_numel), num_shards))
        sizes = dict(named_numels)
        rows = row_numels or {}
        offsets = [o for o, _ in starts]
        cuts = [0]
        for i in range(1, count):
            ideal = i * total // count
            p = bisect.bisect_right(offsets, ideal) - 1
            start, name = starts[p]
            end = start + sizes[name]
            slack = max(1, total // count // 4)
            near = min((start, end), key=lambda b: abs(b - ideal))
            if abs(near - ideal) <= slack:
                cut = near
            else:
                row = max(1, rows.get(name, 1))
                cut = start + round((ideal - start) / row) * row
            if not cuts[-1] < cut < total or cut - cuts[-1] > chunk_numel:
                cut = ideal  # snapping would break a size limit: cut where planned
            if cut > cuts[-1]:
                cuts.append(cut)
        cuts.append(total)
        ranges: list[tuple[int, int]] = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            while hi - lo > chunk_numel:  # a snapped neighbour made this one too long
                ranges.append((lo, lo + chunk_numel))
                lo += chunk_numel
            if hi > lo:
                ranges.append((lo, hi))
        pieces: list[Chunk] = []
        for i, (lo, hi) in enumerate(ranges):
            p = bisect.bisect_right(offsets, lo) - 1
            offset, name = starts[p]
            pieces.append(Chunk(i, name, lo - offset, lo, hi - lo, -1))
        placement = _greedy(pieces, num_shards)
        chunks = tuple(
            Chunk(c.index, c.name, c.param_offset, c.flat_offset, c.numel, placement[c.index])
            for c in pieces
        )
        params = tuple((str(n), int(k)) for n, k in named_numels)
        return cls(params=params, num_shards=num_shards, chunk_numel=chunk_numel, chunks=chunks)

    @classmethod
    def _build_at_cuts(cls, named_numels: list[tuple[str, int]], num_shards: int, chunk_numel: int, *,
                       rows_of: dict[str, int], starts: list[tuple[int, str]], total: int,
                       cuts: Iterable[int]) -> ShardPlan:
        bounds = {0, total} | {o for o, _ in starts} | {c for c in cuts if 0 < c < total}
        ranges: list[tuple[int, int, int]] = []  # lo, hi, elements per row of the parameter
        offsets = [o for o, _ in starts]
        edges = sorted(bounds)
        for lo, hi in zip(edges, edges[1:], strict=False):
            start, name = starts[bisect.bisect_right(offsets, lo) - 1]
            row = max(1, rows_of.get(name, 1)) if (lo - start) % max(1, rows_of.get(name, 1)) == 0 else 1
            ranges.append((lo, hi, row))
        pieces: list[tuple[int, int, int]] = []
        for lo, hi, row in ranges:
            n = -(-(hi - lo) // chunk_numel)
            marks = [lo + round(i * (hi - lo) / n / row) * row for i in range(n)] + [hi]
            for a, b in zip(marks, marks[1:], strict=False):
                while b - a > chunk_numel:  # row rounding overshot: cut where the limit says
                    pieces.append((a, a + chunk_numel, row))
                    a += chunk_numel
                if b > a:
                    pieces.append((a, b, row))
        while 0 < len(pieces) < num_shards:  # one chunk per shard at least: halve the largest
            i = max(range(len(pieces)), key=lambda k: pieces[k][1] - pieces[k][0])
            a, b, row = pieces[i]
            if b - a < 2:
                break
            mid = a + max(1, (b - a) // 2 // row * row) if b - a >= 2 * row else a + (b - a) // 2
            pieces[i : i + 1] = [(a, mid, row), (mid, b, row)]
        chunks = []
        for i, (lo, hi, _) in enumerate(pieces):
            offset, name = starts[bisect.bisect_right(offsets, lo) - 1]
            chunks.append(Chunk(i, name, lo - offset, lo, hi - lo, -1))
        placement = _greedy(chunks, num_shards)
        placed = tuple(Chunk(c.index, c.name, c.param_offset, c.flat_offset, c.numel, placement[c.index])
                       for c in chunks)
        params = tuple((str(n), int(k)) for n, k in named_numels)
        return cls(params=params, num_shards=num_shards, chunk_numel=chunk_numel, chunks=placed)

    @classmethod
    def for_module(
        cls, module: torch.nn.Module, num_shards: int, chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        align: str = "pack",
    ) -> ShardPlan:
        """`build` from `module.named_parameters()`.

        `align`: "pack" packs small parameters into shared chunks (fewest frames); "param"
        cuts at every parameter (a pipeline stage then exchanges whole chunks); "fsdp" also
        cuts wherever FSDP2 splits a parameter's rows over 2..8 local ranks, so each rank of
        an FSDP node exchanges whole chunks of its own shard and nobody gathers the model.
        """
        named = [(n, p.numel()) for n, p in module.named_parameters()]
        rows = {n: p[0].numel() for n, p in module.named_parameters() if p.dim() >= 2 and len(p)}
        if align == "pack":
            return cls.build(named, num_shards, chunk_numel, rows)
        if align not in ("param", "fsdp"):
            raise ConfigError("align", f"unknown plan alignment {align!r}; choose pack, param or fsdp")
        cuts: set[int] = set()
        if align == "fsdp":
            offset = 0
            for _, p in module.named_parameters():
                if p.dim() >= 1 and p.shape[0] > 1:
                    per_row = p.numel() // p.shape[0]
                    cuts.update(offset + r * per_row for r in fsdp_row_cuts(p.shape[0]))
                offset += p.numel()
        return cls.build(named, num_shards, chunk_numel, rows, cuts=cuts)

    @classmethod
    def for_experiment(cls, module: torch.nn.Module, exp: Any) -> ShardPlan:
        """The plan every process of experiment `exp` agrees on (its parallelism picks `align`)."""
        align = {"fsdp": "fsdp", "pipeline": "param"}.get(exp.parallelism, "pack")
        # Without servers (gossip may say num_ps_shards = 0) the plan is only the flat layout: one shard.
        return cls.for_module(module, max(1, exp.num_ps_shards), exp.chunk_numel, align=align)

    @property
    def total_numel(self) -> int:
        return sum(n for _, n in self.params)

    def chunks_of_shard(self, shard: int) -> list[Chunk]:
        """The chunks placed on `shard`, by index."""
        return [c for c in self.chunks if c.shard == shard]

    def chunks_of_rank(self, rank: int, world: int) -> list[Chunk]:
        """The chunks local rank `rank` of `world` exchanges (greedy balance over all chunks)."""
        if world <= 0 or not 0 <= rank < world:
            raise ConfigError("rank", f"rank {rank} is not in a world of {world}")
        # Worked out once per world size (a trainer asks every step); the plan is immutable.
        by_rank = self._by_rank.get(world)
        if by_rank is None:
            placement = _greedy(self.chunks, world)
            by_rank = self._by_rank[world] = tuple(
                tuple(c for c in self.chunks if placement[c.index] == r) for r in range(world))
        return list(by_rank[rank])

    @functools.cached_property
    def _by_rank(self) -> dict[int, tuple[tuple[Chunk, ...], ...]]:
        return {}

    def shard_numel(self, shard: int) -> int:
        return sum(c.numel for c in self.chunks if c.shard == shard)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description (it travels inside assignments)."""
        return {
            "num_shards": self.num_shards,
            "chunk_numel": self.chunk_numel,
            "params": [[n, k] for n, k in self.params],
            "chunks": [
                [c.index, c.name, c.param_offset, c.flat_offset, c.numel, c.shard]
                for c in self.chunks
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardPlan:
        """Inverse of `to_dict`; checks the chunks tile every parameter exactly once.

        Raises:
            ConfigError: the description is malformed or inconsistent.
        """
        try:
            num_shards = int(d["num_shards"])
            chunk_numel = int(d["chunk_numel"])
            params = tuple((str(n), int(k)) for n, k in d["params"])
            chunks = tuple(
                Chunk(int(i), str(n), int(po), int(fo), int(k), int(s))
                for i, n, po, fo, k, s in d["chunks"]
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError("plan", f"malformed shard plan: {e}") from e
        plan = cls(params=params, num_shards=num_shards, chunk_numel=chunk_numel, chunks=chunks)
        plan._validate()
        return plan

    def _validate(self) -> None:
        starts: dict[str, int] = {}
        total = 0
        for name, numel in self.params:
            starts[name] = total
            total += numel
        flat = 0
        for i, c in enumerate(self.chunks):
            if c.index != i:
                raise ConfigError("plan", f"chunk {i} has index {c.index}")
            if not 0 <= c.shard < self.num_shards:
                raise ConfigError("plan", f"chunk {i} is on shard {c.shard} of {self.num_shards}")
            if c.name not in starts:
                raise ConfigError("plan", f"chunk {i} names unknown parameter {c.name!r}")
            if c.flat_offset != flat or c.flat_offset != starts[c.name] + c.param_offset:
                raise ConfigError("plan", f"chunk {i} does not continue where chunk {i - 1} ended")
            if not 0 < c.numel <= self.chunk_numel:
                raise ConfigError("plan", f"chunk {i} has {c.numel} elements")
            flat += c.numel
        if flat != total:
            raise ConfigError("plan", f"chunks cover {flat} of {total} elements")

    def fingerprint(self) -> str:
        """A short stable hash of the plan (equal plans, equal fingerprints)."""
        blob = json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def gather(
        self, flat: torch.Tensor, chunks: Iterable[Chunk] | None = None
    ) -> dict[int, torch.Tensor]:
        """Views of `flat` (the flat parameter/gradient vector) for each chunk, by index."""
        chosen = self.chunks if chunks is None else chunks
        return {c.index: flat[c.flat_offset : c.flat_offset + c.numel] for c in chosen}

    def scatter(self, flat: torch.Tensor, values: dict[int, torch.Tensor]) -> None:
        """Copy chunk values (by index) into their place in `flat`."""
        for idx, v in values.items():
            c = self.chunks[idx]
            flat[c.flat_offset : c.flat_offset + c.numel].copy_(v.reshape(-1))


def flatten_params(module: torch.nn.Module) -> torch.Tensor:
    """The module's parameters concatenated in `named_parameters()` order, as fp32."""
    parts = [p.detach().reshape(-1).to(torch.float32) for _, p in module.named_parameters()]
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def take_shard_values(module: torch.nn.Module, plan: ShardPlan, shard: int) -> dict[int, torch.Tensor]:
    """The fp32 values of `shard`'s chunks, copied from `module`'s parameters, which are emptied as they are read.

    A shard builds the whole seeded model only for its initial values: reading them straight into
    its chunks, one parameter at a time and dropping each one read, never holds the model twice
    (a flat copy and the chunks cut from it would: 2.5x the model at a shard's start).
    """
    chunks = sorted(plan.chunks_of_shard(shard), key=lambda c: c.flat_offset)
    starts = [c.flat_offset for c in chunks]
    out: dict[int, torch.Tensor] = {}
    offset = 0
    with torch.no_grad():
        for _, p in module.named_parameters():
            lo, hi = offset, offset + p.numel()
            flat = p.detach().reshape(-1)
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            while i < len(chunks) and chunks[i].flat_offset < hi:
                c = chunks[i]
                a, b = max(lo, c.flat_offset), min(hi, c.flat_offset + c.numel)
                if a < b:
                    if c.index not in out:
                        out[c.index] = torch.empty(c.numel, dtype=torch.float32)
                    out[c.index][a - c.flat_offset : b - c.flat_offset].copy_(flat[a - lo : b - lo])
                i += 1
            p.data = torch.empty(0, dtype=p.dtype)
            offset = hi
    return out


def flatten_grads(module: torch.nn.Module) -> torch.Tensor:
    """The module's gradients in `flatten_params` layout (zeros where a grad is missing)."""
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
        for _, p in module.named_parameters()
    ]
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def unflatten_into(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a `flatten_params`-layout vector back into the module's parameters in place."""
    total = sum(p.numel() for p in module.parameters())
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} elements, module has {total}")
    offset = 0
    with torch.no_grad():
        for _, p in module.named_parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
