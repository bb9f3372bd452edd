"""Copy-on-write for a shard's tensors: a write to a storage still being read runs out of place instead of in it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WritesAside", "storage_of"]


def storage_of(t: torch.Tensor) -> int:
    """The address of `t`'s storage: tensors sharing it share their values."""
    return int(t.untyped_storage().data_ptr())


_MUTABLE: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of the arguments it writes


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors `func` writes into (its schema's mutable arguments)."""
    mutable = _MUTABLE.get(func)
    if mutable is None:
        mutable = _MUTABLE[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                         if a.alias_info is not None and a.alias_info.is_write)
    out: list[torch.Tensor] = []
    for i, name in mutable:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _functional(func: Any) -> Any | None:
    """`aten.add.Tensor` for `aten.add_.Tensor` (the same kernel writing a new tensor), or None."""
    name = func.overloadpacket.__name__
    if not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, func._overloadname, None) if packet is not None else None


def _move(t: torch.Tensor, to: torch.Tensor) -> None:
    """`t` takes `to`'s storage (other tensors on `t`'s old storage keep it)."""
    t.set_(to.untyped_storage(), to.storage_offset(), to.size(), to.stride())


class WritesAside(TorchDispatchMode):
    """While active, an in-place write to a tensor on a `frozen` storage runs out of place.

    ``p.add_(g, alpha=-lr)`` on a frozen ``p`` becomes ``p.set_(torch.add(p, g, alpha=-lr))``:
    the same kernel, so the same bits, written to new memory that ``p`` then uses; every other
    tensor on the old storage (a checkpoint snapshot's piece, a reply ZMQ still sends) keeps the
    old values, and nothing is copied. Later writes to ``p`` are in place again (its new storage
    is not frozen). A write this cannot turn around (an ``out=`` argument, an op without a
    functional twin) first moves the tensor to a copy, counted in `copies`.

    Any torch optimizer works under it unchanged (they write with in-place ops); the shard's
    writes run under it only while something reads the live values (`ShardState.writes`).
    """

    def __init__(self, frozen: set[int], release: Callable[[int], set[int]] | None = None) -> None:
        """`release(storage)`: called before writing a frozen storage; returns the storages the
        reader let go of meanwhile (a snapshot whose copy of them is ready), written in place."""
        super().__init__()
        self.frozen = frozen
        self.release = release
        self.moved = 0  # tensors written out of place
        self.copies = 0  # tensors copied first (writes with no out-of-place twin)
        self.copy_s = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        hit = [storage_of(t) for t in written if storage_of(t) in self.frozen]
        if hit and self.release is not None:
            for ptr in hit:
                self.frozen -= self.release(ptr)
            hit = [ptr for ptr in hit if ptr in self.frozen]
        if not hit:
            return func(*args, **kwargs)
        functional = _functional(func)
        first: Any = args[0] if args else None
        targets: list[torch.Tensor] = list(first) if isinstance(first, list | tuple) else [first]
        if functional is not None and all(any(t is w for w in targets) for t in written):
            result = functional(*args, **kwargs)
            results = result if isinstance(first, list | tuple) else [result]
            for t, r in zip(targets, results, strict=True):
                _move(t, r)
            self.moved += len(targets)
            return None if isinstance(first, list | tuple) else first  # as the in-place op returns
        t0 = time.perf_counter()
        for t in written:
            if storage_of(t) in self.frozen:
                _move(t, t.clone())
                self.copies += 1
        self.copy_s += time.perf_counter() - t0
        return func(*args, **kwargs)
