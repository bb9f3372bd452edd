"""`TrainContext.data` on nodes of several local ranks: each process's share of its worker's batches, disjoint."""

from __future__ import annotations

import itertools

import pytest
import torch

from gossamer.core.experiment import Experiment
from gossamer.training.train_function import TrainContext, _Runtime

DATA = [(torch.tensor([float(i)]), i) for i in range(200)]


class _Place(_Runtime):
    """Process `local_rank` of `local_world` on the node of worker rank `worker` of `workers`."""

    def __init__(self, exp: Experiment, worker: int, workers: int, local_rank: int, local_world: int) -> None:
        super().__init__(exp)
        self._w, self._n, self._l, self._lw = worker, workers, local_rank, local_world

    worker_index = property(lambda self: self._w)  # type: ignore[assignment]
    worker_rank = property(lambda self: self._w)  # type: ignore[assignment]
    num_workers = property(lambda self: self._n)  # type: ignore[assignment]
    local_rank = property(lambda self: self._l)  # type: ignore[assignment]
    local_world_size = property(lambda self: self._lw)  # type: ignore[assignment]
    rank = property(lambda self: self._w * self._lw + self._l)  # type: ignore[assignment]
    world_size = property(lambda self: self._n * self._lw)  # type: ignore[assignment]


def _first_batch(exp: Experiment, *place: int, **kw: object) -> list[int]:
    return next(iter(TrainContext(_Place(exp, *place)).data(DATA, **kw)))[1].tolist()  # type: ignore[arg-type]


@pytest.mark.parametrize(("workers", "local"), [(1, 2), (2, 2), (3, 2)])
def test_sync_cuts_each_workers_share_of_the_global_batch_among_its_local_ranks(workers: int, local: int) -> None:
    exp = Experiment(name="x", train="m:f", mode="sync", num_ps_shards=1, global_batch_size=12, total_steps=5)
    one = _first_batch(exp, 0, 1, 0, 1)
    shares = [_first_batch(exp, w, workers, r, local) for w, r in itertools.product(range(workers), range(local))]
    assert sorted(itertools.chain(*shares)) == sorted(one) and len(one) == 12  # the same 12 samples, cut
    assert all(abs(len(s) - 12 / (workers * local)) < 1 for s in shares), shares


def test_async_deals_each_node_batch_out_to_its_local_ranks() -> None:
    exp = Experiment(name="x", train="m:f", mode="async", num_ps_shards=1, total_steps=5)
    a, b = (_first_batch(exp, 1, 2, r, 2, batch_size=8) for r in range(2))
    assert len(a) == len(b) == 8 and not set(a) & set(b)  # each rank its own 8 of the node's 16
    assert _first_batch(exp, 1, 2, 0, 1, batch_size=8) == _first_batch(exp, 1, 2, 0, 1, batch_size=8)
    other = _first_batch(exp, 0, 2, 0, 2, batch_size=8)
    assert set(other) != set(a)  # another worker draws from its own stream
