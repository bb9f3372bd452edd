"""A stream's items sent from DataLoader worker processes in blocks, every tensor of a block in one shared buffer."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

__all__ = ["STREAM_BLOCK_BYTES", "STREAM_BLOCK_ITEMS", "Blocks", "keep", "pack", "unpack", "unpack_blocks"]

#: A block holds this many of a stream's items, or fewer where their tensors reach `STREAM_BLOCK_BYTES`.
#: Sent one item at a time, each tensor of each item went over as a shared-memory file of its own, whose
#: descriptor the reader fetched over a socket with an authentication round trip: about 1 ms a tensor, so
#: a step of 32 (x, y) pairs waited 60-70 ms on its input.
STREAM_BLOCK_ITEMS = 64
STREAM_BLOCK_BYTES = 16 << 20

_ALIGN = 64  # each tensor's bytes start at a multiple of this (any dtype may be viewed there)

#: Where one tensor lies in a block's buffer: (offset, dtype, shape).
_Place = tuple[int, torch.dtype, tuple[int, ...]]


def _sendable(obj: object) -> bool:
    """A plain dense CPU tensor, whose bytes (and dtype and shape) are all the reader needs."""
    return (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
            and not obj.requires_grad and not obj.is_quantized and not obj.is_conj() and not obj.is_neg())


class _Collect(pickle.Pickler):
    """Pickles items with each sendable tensor replaced by its number in `tensors`."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: object) -> int | None:
        if not _sendable(obj):
            return None
        self.tensors.append(obj)  # type: ignore[arg-type]
        return len(self.tensors) - 1


class _Restore(pickle.Unpickler):
    """Unpickles items with each tensor a view of the block's buffer."""

    def __init__(self, payload: bytes, buf: torch.Tensor, places: list[_Place]) -> None:
        super().__init__(io.BytesIO(payload))
        self.buf, self.places = buf, places

    def persistent_load(self, pid: object) -> torch.Tensor:
        offset, dtype, shape = self.places[int(pid)]  # type: ignore[call-overload]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self.buf[offset:offset + nbytes].view(dtype).view(shape)


def _shared_bytes(n: int) -> torch.Tensor:
    """n bytes; in a DataLoader worker, in shared memory from the start (sending it then copies nothing)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(n, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8).untyped_storage()._new_shared(n)  # as default_collate does
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def pack(items: list[Any]) -> tuple[bytes, torch.Tensor, list[_Place]]:
    """`items` as (their pickle without the tensors, one byte buffer holding every tensor, where each lies)."""
    out = io.BytesIO()
    pickler = _Collect(out)
    pickler.dump(items)
    places: list[_Place] = []
    size = 0
    for t in pickler.tensors:
        places.append((size, t.dtype, tuple(t.shape)))
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buf = _shared_bytes(size)
    for t, (offset, dtype, shape) in zip(pickler.tensors, places, strict=True):
        nbytes = t.numel() * t.element_size()
        buf[offset:offset + nbytes].view(dtype).view(shape).copy_(t)
    return out.getvalue(), buf, places


def unpack(block: tuple[bytes, torch.Tensor, list[_Place]]) -> list[Any]:
    """The items `pack` was given; their tensors are views of the block's one buffer."""
    payload, buf, places = block
    items: list[Any] = _Restore(payload, buf, places).load()
    return items


def unpack_blocks(blocks: Iterator[tuple[bytes, torch.Tensor, list[_Place]]]) -> Iterator[Any]:
    """The items of each block in turn."""
    for block in blocks:
        yield from unpack(block)


def _nbytes(item: Any) -> int:
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, Mapping):  # transformers' BatchEncoding is a Mapping, not a dict
        return sum(_nbytes(v) for v in item.values())
    if isinstance(item, (tuple, list)):
        return sum(_nbytes(v) for v in item)
    return 0


class Blocks(IterableDataset):  # type: ignore[type-arg]
    """A stream (an IterableDataset) as packed blocks of its items, in its order; the last block may be short.

    Iterated in a DataLoader worker, the stream inside splits itself across the workers by
    `get_worker_info()` as it would unwrapped.
    """

    def __init__(self, ds: Any, items: int = STREAM_BLOCK_ITEMS, max_bytes: int = STREAM_BLOCK_BYTES) -> None:
        self.ds, self.items, self.max_bytes = ds, items, max_bytes

    def __iter__(self) -> Iterator[tuple[bytes, torch.Tensor, list[_Place]]]:
        block: list[Any] = []
        size = 0
        for item in self.ds:
            block.append(item)
            size += _nbytes(item)
            if len(block) >= self.items or size >= self.max_bytes:
                yield pack(block)
                block, size = [], 0
        if block:
            yield pack(block)


def keep(block: Any) -> Any:
    """The DataLoader's collate for blocks: none (the default would convert inside them)."""
    return block
