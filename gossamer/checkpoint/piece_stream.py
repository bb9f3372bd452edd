"""What a shard checkpoint's pieces are: their listing, and the stream a live snapshot is written from."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["PieceStream", "Pieces"]

#: (flat offset, numel, the state names saved for it) of each piece of a shard.
Pieces = list[tuple[int, int, list[str]]]


class PieceStream(Protocol):
    """Where a snapshot's piece tensors come from while it is written (`ShardSnapshot.stream`)."""

    def take(self, offset: int, name: str) -> torch.Tensor:
        """The tensor of piece `offset`'s `name`, to be written now (nothing writes it until `written`)."""
        ...

    def written(self, offset: int, name: str) -> None:
        """That tensor is in the file: its source may change or go."""
        ...

    def close(self) -> None:
        """The save ended (written, failed or abandoned): every tensor is released."""
        ...
