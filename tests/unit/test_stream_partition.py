"""Streams are read in disjoint pieces, by position, deterministically; batches are read ahead of the step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, TensorDataset

from gossamer.core.errors import ConfigError
from gossamer.engine.batches import Data
from gossamer.engine.loader import StepLoader
from gossamer.engine.sampler import stream_span


class Counting(IterableDataset):  # type: ignore[type-arg]
    """0, 1, 2, ... (up to `n`, or endless), counting how often it was started."""

    def __init__(self, n: int | None = None) -> None:
        self.n, self.starts = n, 0

    def __iter__(self) -> Iterator[int]:
        self.starts += 1
        i = 0
        while self.n is None or i < self.n:
            yield i
            i += 1


@given(st.integers(0, 50), st.integers(1, 64), st.integers(1, 8))
def test_a_steps_pieces_cover_its_span_once_whatever_the_workers(step: int, per_step: int, workers: int) -> None:
    pieces = [stream_span(step, per_step, workers, w) for w in range(workers)]
    assert pieces[0][0] == step * per_step and pieces[-1][1] == (step + 1) * per_step
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))  # contiguous, no overlap


@given(st.integers(1, 6), st.integers(1, 16), st.lists(st.integers(0, 30), min_size=2, max_size=6))
def test_workers_at_any_mix_of_own_steps_never_read_the_same_position(workers: int, batch: int,
                                                                      steps: list[int]) -> None:
    """Async: each worker at its own step reads its piece of step x (batch x workers) positions."""
    seen: set[int] = set()
    for w, s in enumerate(steps[:workers]):
        lo, hi = stream_span(s, batch * workers, workers, w)
        assert hi - lo == batch and not seen & set(range(lo, hi))
        seen |= set(range(lo, hi))


def test_stream_reads_by_position_and_keeps_the_last_span_for_a_redone_step() -> None:
    ds = Counting()
    data = Data(ds)
    assert data.stream and data.read(3, 6) == [3, 4, 5]
    assert data.read(3, 6) == [3, 4, 5] and ds.starts == 1  # the step computed again: no new pass
    assert data.read(10, 12) == [10, 11] and ds.starts == 1  # forward: skips on
    assert data.read(0, 2) == [0, 1] and ds.starts == 2  # backward: a new pass from the start


def test_a_finite_stream_repeats_from_its_start() -> None:
    data = Data(Counting(5))
    assert data.read(3, 8) == [3, 4, 0, 1, 2]
    assert data.read(12, 14) == [2, 3]


def test_an_empty_stream_and_a_non_dataset_are_named() -> None:
    with pytest.raises(ConfigError, match="^dataset: .*empty"):
        Data(Counting(0)).read(0, 1)
    with pytest.raises(ConfigError, match="^dataset: .*IterableDataset"):
        Data(3)


def test_eval_of_an_endless_stream_stops_at_its_limit() -> None:
    sizes = [len(sel) for sel in Data(Counting()).eval_selections(4, limit=10)]
    assert sizes == [4, 4, 2]


class _Recording(StepLoader):
    def __init__(self, data: Data, **kw: Any) -> None:
        super().__init__(data, **kw)
        self.made: list[tuple[Any, ...]] = []

    def make(self, want: tuple[Any, ...]) -> Any:
        self.made.append(want)
        return super().make(want)


def test_prefetch_reads_the_next_steps_ahead_and_rereads_after_a_membership_change() -> None:
    data = Data(TensorDataset(torch.arange(100.0), torch.arange(100)))
    loader = _Recording(data, prefetch=2)
    workers = [1]

    def want_at(step: int) -> tuple[Any, ...]:
        return ("idx", tuple(range(step * 4 * workers[0], step * 4 * workers[0] + 4)))

    try:
        x, _ = loader.get(0, want_at)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
        x, _ = loader.get(1, want_at)  # read ahead while step 0 ran
        assert x.tolist() == [4.0, 5.0, 6.0, 7.0]
        assert loader.made.count(want_at(1)) == 1  # read once, ahead: the step took the prefetched batch
        workers[0] = 2  # the membership changed: step 2's samples are others now
        x, _ = loader.get(2, want_at)
        assert x.tolist() == [16.0, 17.0, 18.0, 19.0] and loader.made.count(want_at(2)) == 1
    finally:
        loader.close()


def test_dataloader_workers_give_each_step_its_own_samples_and_replan_on_a_change() -> None:
    data = Data(TensorDataset(torch.arange(64.0), torch.arange(64)))
    loader = StepLoader(data, num_workers=2, prefetch=2)
    shift = [0]

    def want_at(step: int) -> tuple[Any, ...]:
        return ("idx", tuple(range(step * 4 + shift[0], step * 4 + shift[0] + 4)))

    try:
        for step in range(3):
            assert loader.get(step, want_at)[0].tolist() == [float(step * 4 + i) for i in range(4)]
        shift[0] = 1
        assert loader.get(3, want_at)[0].tolist() == [13.0, 14.0, 15.0, 16.0]
    finally:
        loader.close()


def test_a_hugging_face_dataset_is_read_as_dict_batches_of_tensors() -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"features": [[float(i), 1.0] for i in range(6)], "labels": list(range(6))})
    batch = Data(ds).batch(torch.tensor([1, 4]))
    assert batch["features"].tolist() == [[1.0, 1.0], [4.0, 1.0]] and batch["labels"].tolist() == [1, 4]
