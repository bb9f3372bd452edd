"""Data order: a function of (seed, epoch, step); the sync global batch does not depend on worker count."""

from __future__ import annotations

import torch

from gossamer.engine import sampler


def test_global_batch_split_covers_it_exactly_for_any_worker_count() -> None:
    g = sampler.sync_global_batch(1000, 48, step=7, seed=3)
    for workers in (1, 2, 3, 5, 7):
        parts = [sampler.even_split(g, workers, w) for w in range(workers)]
        assert torch.equal(torch.cat(parts), g)


def test_epochs_reshuffle_and_are_reproducible() -> None:
    a = sampler.sync_global_batch(100, 10, step=0, seed=1)
    b = sampler.sync_global_batch(100, 10, step=10, seed=1)  # next epoch, same position
    assert not torch.equal(a, b)
    assert torch.equal(a, sampler.sync_global_batch(100, 10, step=0, seed=1))
    epoch = torch.cat([sampler.sync_global_batch(100, 10, step=s, seed=1) for s in range(10)])
    assert sorted(epoch.tolist()) == list(range(100))


def test_async_workers_draw_different_streams() -> None:
    a = sampler.async_batch(500, 32, step=0, seed=0, worker=0)
    b = sampler.async_batch(500, 32, step=0, seed=0, worker=1)
    assert not torch.equal(a, b)


def test_index_tuple_matches_element_by_element() -> None:
    from gossamer.engine.loader import index_tuple

    idx = sampler.async_batch(1797, 32, 7, 0, 0)
    got = index_tuple(idx)
    assert got == tuple(int(i) for i in idx) and all(type(i) is int for i in got)
    assert index_tuple([3, 1, 2]) == (3, 1, 2)
