"""Chunk values rebuilt from the compressed parameter differences a shard sends (pull compression)."""

from __future__ import annotations

from typing import Any

import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import ProtocolError, ShardError
from gossamer.transport.frames import Message

__all__ = ["apply_deltas"]


def apply_deltas(decoder: ChunkCompressor | None, held: dict[int, torch.Tensor], shard: int, reply: Message,
                 compressed: dict[str, Any]) -> dict[int, torch.Tensor]:
    """The chunk values of `reply` from shard `shard`: its compressed differences added to what we `held`.

    Raises:
        ShardError: differences nobody asked for (no `decoder`), for a chunk not held, or undecodable.
    """
    if decoder is None:
        raise ShardError(f"shard {shard} sent compressed parameters we did not ask for")
    out: dict[int, torch.Tensor] = {}
    for key, cmeta in compressed.items():
        idx = int(key) if isinstance(key, str) and key.isdigit() else -1
        if idx not in held:
            raise ShardError(f"shard {shard} sent a difference for chunk {key!r} we do not hold")
        try:
            out[idx] = held[idx] + decoder.decode(idx, reply.tensors, cmeta)
        except ProtocolError as e:
            raise ShardError(f"shard {shard} sent an undecodable difference: {e}") from e
    return out
