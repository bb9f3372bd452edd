"""How the flat fp32 parameter vector is cut into chunks and placed on shards and local ranks."""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gossamer.errors import ConfigError

__all__ = ["Chunk", "ShardPlan", "flatten_grads", "flatten_params", "unflatten_into"]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_NUMEL = 1 << 20


@dataclass(frozen=True)
class Chunk:
    """A contiguous piece of one parameter.

    `param_offset` is the offset inside the (flattened) parameter `name`, `flat_offset` the
    offset in the concatenation of all parameters in `named_parameters()` order.
    """

    index: int
    name: str
    param_offset: int
    flat_offset: int
    numel: int
    shard: int


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
    ) -> ShardPlan:
        """Cut each parameter into chunks of at most `chunk_numel` and place them greedily.

        Raises:
            ConfigError: on a non-positive `num_shards`/`chunk_numel`, a negative size or a
                duplicate parameter name.
        """
        if not isinstance(num_shards, int) or num_shards <= 0:
            raise ConfigError("num_shards", f"must be a positive int, got {num_shards!r}")
        if not isinstance(chunk_numel, int) or chunk_numel <= 0:
            raise ConfigError("chunk_numel", f"must be a positive int, got {chunk_numel!r}")
        seen: set[str] = set()
        pieces: list[Chunk] = []
        flat = 0
        for name, numel in named_numels:
            if name in seen:
                raise ConfigError("named_numels", f"duplicate parameter {name!r}")
            if not isinstance(numel, int) or numel < 0:
                raise ConfigError("named_numels", f"{name!r} has bad numel {numel!r}")
            seen.add(name)
            for off in range(0, numel, chunk_numel):
                n = min(chunk_numel, numel - off)
                pieces.append(Chunk(len(pieces), name, off, flat + off, n, -1))
            flat += numel
        placement = _greedy(pieces, num_shards)
        chunks = tuple(
            Chunk(c.index, c.name, c.param_offset, c.flat_offset, c.numel, placement[c.index])
            for c in pieces
        )
        params = tuple((str(n), int(k)) for n, k in named_numels)
        return cls(params=params, num_shards=num_shards, chunk_numel=chunk_numel, chunks=chunks)

    @classmethod
    def for_module(
        cls, module: torch.nn.Module, num_shards: int, chunk_numel: int = DEFAULT_CHUNK_NUMEL
    ) -> ShardPlan:
        """`build` from `module.named_parameters()`."""
        named = [(n, p.numel()) for n, p in module.named_parameters()]
        return cls.build(named, num_shards, chunk_numel)

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
        placement = _greedy(self.chunks, world)
        return [c for c in self.chunks if placement[c.index] == rank]

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
        offsets = {}
        flat = 0
        for name, numel in self.params:
            offsets[name] = (flat, numel)
            flat += numel
        covered = {name: 0 for name, _ in self.params}
        for i, c in enumerate(self.chunks):
            if c.index != i:
                raise ConfigError("plan", f"chunk {i} has index {c.index}")
            if not 0 <= c.shard < self.num_shards:
                raise ConfigError("plan", f"chunk {i} is on shard {c.shard} of {self.num_shards}")
            if c.name not in offsets:
                raise ConfigError("plan", f"chunk {i} names unknown parameter {c.name!r}")
            base, numel = offsets[c.name]
            if c.param_offset != covered[c.name] or c.flat_offset != base + c.param_offset:
                raise ConfigError("plan", f"chunk {i} does not continue parameter {c.name!r}")
            if c.numel <= 0 or c.param_offset + c.numel > numel:
                raise ConfigError("plan", f"chunk {i} overruns parameter {c.name!r}")
            covered[c.name] += c.numel
        for name, numel in self.params:
            if covered[name] != numel:
                raise ConfigError("plan", f"parameter {name!r} is not fully covered")

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
