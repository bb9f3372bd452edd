"""A stream read through DataLoader worker processes comes over in blocks whose tensors share one buffer."""

from __future__ import annotations

import multiprocessing as mp
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

from gossamer.engine.batches import Data
from gossamer.engine.loader import StepLoader
from gossamer.engine.stream_blocks import Blocks, keep, pack, unpack, unpack_blocks

Pair = namedtuple("Pair", "x y")


class Shared(IterableDataset):  # type: ignore[type-arg]
    """Items 0..n-1 as (x, y) tensors, split across DataLoader workers by `get_worker_info()`, as users must."""

    def __init__(self, n: int, width: int = 3) -> None:
        self.n, self.width = n, width

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        k, of = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(k, self.n, of):
            yield torch.full((self.width,), float(i)), torch.tensor(i)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_pack_keeps_every_structure_dtype_and_shape_with_the_tensors_in_one_buffer() -> None:
    base = torch.arange(10_000.0)
    grad = torch.ones(2, requires_grad=True)
    items = [
        (torch.randn(3), torch.tensor(7)),
        {"input_ids": torch.arange(6).view(2, 3), "labels": base[5:9], "text": "abc", "n": 3},
        Pair(torch.randn(4, 4).t(), torch.ones(2, 3, dtype=torch.bool)),  # not contiguous; bool
        [torch.zeros(0), torch.tensor(1 + 2j), torch.tensor([1, 2], dtype=torch.int8), 2.5, None],
        grad,  # a tensor that requires grad keeps it: pickled whole, as before
    ]
    payload, buf, places = pack(items)
    assert len(places) == 9 and buf.dtype == torch.uint8
    assert all(off % 64 == 0 for off, _, _ in places)
    # A view of a large storage sends its own bytes only, not the storage under it.
    assert buf.numel() < base.numel() * 4
    out = unpack((payload, buf, places))
    assert _same(out[:4], items[:4])
    assert out[4].requires_grad and torch.equal(out[4].detach(), grad.detach())
    assert type(out[2]) is Pair
    # The items' tensors are views of the block's one buffer (what crossed the process boundary).
    assert out[1]["labels"].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_blocks_cut_a_stream_by_items_and_by_bytes_and_send_a_finite_streams_rest() -> None:
    counts = [len(unpack(b)) for b in Blocks(Shared(150), items=64)]
    assert counts == [64, 64, 22]
    by_bytes = [len(unpack(b)) for b in Blocks(Shared(10, width=256), items=64, max_bytes=4 * 1024)]
    assert by_bytes == [4, 4, 2]  # 1 KiB + 8 B an item: a block closes once it reaches 4 KiB


def test_a_stream_through_two_loader_processes_arrives_whole_in_blocks() -> None:
    loader = DataLoader(Blocks(Shared(200), items=16), batch_size=None, collate_fn=keep, num_workers=2,
                        multiprocessing_context="fork")
    blocks = list(loader)
    assert len(blocks) == 14  # 100 items per worker: 6 blocks of 16 and one of 4, each
    seen = sorted(int(y) for _, y in unpack_blocks(iter(blocks)))
    assert seen == list(range(200))


def test_step_loaders_read_through_worker_processes_under_a_forkserver_default() -> None:
    """A role process forked by its node's fork server has multiprocessing's default set to "forkserver"
    (a map-style set's loader, whose collate is a closure, could not be pickled to a worker there)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_read_under_forkserver_default, args=(out,))
    proc.start()
    try:
        stream, mapped = out.get(timeout=120)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert stream == [[float(i)] * 3 for i in range(8, 12)]
    assert mapped == [5.0, 6.0, 7.0]


def _read_under_forkserver_default(out: Any) -> None:
    mp.set_start_method("forkserver", force=True)
    stream = StepLoader(Data(Shared(1000)), num_workers=1, prefetch=2)
    mapped = StepLoader(Data(TensorDataset(torch.arange(10.0), torch.arange(10))), num_workers=1, prefetch=2)
    try:
        x, _ = stream.get(2, lambda step: ("span", step * 4, step * 4 + 4))
        m, _ = mapped.get(0, lambda step: ("idx", (5, 6, 7)))
        out.put(([row.tolist() for row in x], m.tolist()))
    except Exception as e:  # noqa: BLE001 - the test reports it
        out.put((repr(e), []))
    finally:
        stream.close()
        mapped.close()
