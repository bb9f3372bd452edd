"""The experiment's data as batches: map-style sets by index, streams by position, any batch structure (tuple, dict, collate)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from gossamer.core.errors import ConfigError

__all__ = ["Data", "Selection", "batch_samples", "call_model", "describe", "split_batch", "stack_batch",
           "to_device", "without_labels"]

#: What picks a batch's samples: indices into a map-style set, or items already read from a stream.
Selection = torch.Tensor | list[Any]

#: An eval stream with no `eval_samples` bound is read up to this many samples (streams may be endless).
EVAL_STREAM_DEFAULT = 10_000


def stack_batch(ds: Any, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples `idx` of a map-style `ds` of (input, target) pairs as one (inputs, targets) batch."""
    tensors = getattr(ds, "tensors", None)
    if tensors is not None and len(tensors) == 2:
        return tensors[0][idx], tensors[1][idx]
    return _stack_pairs([ds[int(i)] for i in idx])


def _stack_pairs(items: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items])


def collate_items(items: Sequence[Any], collate: Callable[[list[Any]], Any] | None = None) -> Any:
    """One batch of `items`: the user's `collate`, (input, target) pairs stacked, else torch's default_collate."""
    if collate is not None:
        return collate(list(items))
    if items and isinstance(items[0], tuple | list) and len(items[0]) == 2 \
            and all(isinstance(v, torch.Tensor | int | float) or hasattr(v, "__array__") for v in items[0]):
        return _stack_pairs(items)
    return default_collate(list(items))


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (in tuples, lists, dicts, at any depth) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()}) if type(batch) is dict \
            else {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else ()
    for v in values:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def batch_samples(batch: Any) -> int:
    """How many samples `batch` holds: the leading size of its first tensor (1 for a scalar)."""
    t = _first_tensor(batch)
    if t is None:
        raise ConfigError("dataset", f"a batch holds no tensor ({type(batch).__name__}); the data set or `collate` "
                                     "must give tensors, (input, target) pairs or dicts of tensors")
    return int(t.shape[0]) if t.dim() else 1


def split_batch(batch: Any, parts: int, part: int) -> Any:
    """Part `part` of `parts` near-equal pieces of `batch` along its samples (every tensor cut alike)."""
    n = batch_samples(batch)
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    stop = start + base + (1 if part < extra else 0)

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v[start:stop] if v.dim() and v.shape[0] == n else v
        if isinstance(v, Mapping):
            return {k: cut(x) for k, x in v.items()}
        if isinstance(v, tuple | list):
            return type(v)(cut(x) for x in v)
        return v

    return cut(batch)


def describe(batch: Any, depth: int = 0) -> str:
    """A short picture of a batch's structure: "(float32[32, 8], int64[32])", "{input_ids: int64[4, 16]}"."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if depth >= 3:
        return "..."
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v, depth + 1)}" for k, v in list(batch.items())[:8]) + "}"
    if isinstance(batch, tuple | list):
        inner = ", ".join(describe(v, depth + 1) for v in batch[:8])
        return f"({inner})" if isinstance(batch, tuple) else f"[{inner}]"
    return type(batch).__name__


def without_labels(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "labels"}


def call_model(module: Any, inputs: Any) -> Any:
    """`module(**inputs)` for a dict of inputs, else `module(inputs)`."""
    return module(**inputs) if isinstance(inputs, Mapping) else module(inputs)


class Data:
    """A training or eval set as the loop reads it: map-style (by index) or a stream (by position).

    A stream is any torch IterableDataset (endless or finite; a finite one is read again from
    its start once it ends). Hugging Face `datasets.Dataset`s are map-style sets of dict rows,
    read as torch tensors. `collate` (the experiment's `collate` callable) turns a list of
    samples into a batch; without it pairs are stacked and dicts go through default_collate.
    """

    def __init__(self, ds: Any, *, collate: Callable[[list[Any]], Any] | None = None, field: str = "dataset") -> None:
        if _is_hf_dataset(ds):
            ds = ds.with_format("torch")
        self.stream = isinstance(ds, IterableDataset)
        if not self.stream and not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise ConfigError(field, f"the dataset callable must return map-style datasets (with __len__ and "
                                     f"__getitem__), torch IterableDatasets or datasets.Dataset, got {type(ds).__name__}")
        self.ds, self.collate, self.field = ds, collate, field
        #: A fresh iterator over the stream from its start (the loader may read it through worker processes).
        self.iterate: Callable[[], Iterator[Any]] = lambda: iter(self.ds)
        self._it: Iterator[Any] | None = None
        self._pos = 0  # the stream position `_it` yields next
        self._length: int | None = None  # a finite stream's length, once read to its end
        self._kept: tuple[int, list[Any]] = (0, [])  # the last span read (a step computed again reads it again)

    @classmethod
    def wrap(cls, ds: Any, collate: Callable[[list[Any]], Any] | None = None) -> Data:
        return ds if isinstance(ds, Data) else cls(ds, collate=collate)

    def __len__(self) -> int:
        if self.stream:
            raise TypeError("a stream has no length")
        return len(self.ds)

    def batch(self, sel: Selection) -> Any:
        """The batch of the samples `sel` picks (indices of a map-style set, or items read from a stream)."""
        if isinstance(sel, torch.Tensor):
            tensors = getattr(self.ds, "tensors", None)
            if self.collate is None and tensors is not None and len(tensors) == 2:
                return tensors[0][sel], tensors[1][sel]
            sel = [self.ds[int(i)] for i in sel]
        return collate_items(sel, self.collate)

    # --- streams ------------------------------------------------------------------------
    def read(self, start: int, stop: int) -> list[Any]:
        """The stream's items at positions [start, stop) (a finite stream repeats from its start)."""
        kept_start, kept = self._kept
        if kept_start <= start and stop <= kept_start + len(kept):
            return kept[start - kept_start : stop - kept_start]
        out = [self._item(p) for p in range(start, stop)]
        self._kept = (start, out)
        return out

    def _item(self, p: int) -> Any:
        while True:
            if self._length is not None:
                p %= self._length
            if self._it is None or p < self._pos:
                self._it, self._pos = self.iterate(), 0
            try:
                while self._pos <= p:
                    item = next(self._it)
                    self._pos += 1
                return item
            except StopIteration:
                if self._pos == 0:
                    raise ConfigError(self.field, "the data set's stream is empty") from None
                self._length, self._it = self._pos, None

    # --- evaluation -----------------------------------------------------------------------
    def eval_selections(self, batch: int, limit: int = 0) -> Iterator[Selection]:
        """The whole set in selections of at most `batch` samples (a stream: up to `limit` samples, or its end)."""
        if not self.stream:
            n = len(self.ds) if not limit else min(limit, len(self.ds))
            for start in range(0, n, batch):
                yield torch.arange(start, min(n, start + batch))
            return
        cap = limit or EVAL_STREAM_DEFAULT
        it, pending, seen = iter(self.ds), [], 0
        for item in it:
            pending.append(item)
            seen += 1
            if len(pending) == batch or seen == cap:
                yield pending
                pending = []
            if seen == cap:
                break
        if pending:
            yield pending


def _is_hf_dataset(ds: Any) -> bool:
    return type(ds).__module__.startswith("datasets.") and hasattr(ds, "with_format")
