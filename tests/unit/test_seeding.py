"""Seeding: the freshest worker's copy is taken, and each copy's clocks count the updates it lacks exactly."""

from __future__ import annotations

import torch

from gossamer.paramserver._seeding import Seeding


def _copy() -> dict[int, torch.Tensor]:
    return {0: torch.zeros(4)}


def test_the_freshest_copy_is_taken_and_the_acknowledged_updates_it_lacks_are_counted_per_sender() -> None:
    seeding = Seeding({0: 4}, started=0.0, window_s=2.0, deadline_s=60.0)
    # a's copy is the freshest (version 90): every update acknowledged to b (clock 40, at version 70) is in it.
    seeding.offer("a", 90, _copy(), 0.1, {"a": 30, "b": 40})
    seeding.offer("b", 70, _copy(), 0.2, {"a": 22, "b": 40})
    taken = seeding.choice(0.3, frozenset({"a", "b"}))
    assert taken is not None and (taken.sender, taken.version) == ("a", 90)
    assert seeding.lost(taken) == {"a": 0, "b": 0}
    # Taken the older copy instead, a's updates 23..30 (acknowledged to it) would be lost.
    assert seeding.lost(seeding.seeds["b"]) == {"a": 8, "b": 0}


def test_a_copy_without_clocks_makes_no_count_exact() -> None:
    seeding = Seeding({0: 4}, started=0.0, window_s=2.0, deadline_s=60.0)
    seeding.offer("a", 90, _copy(), 0.1, {"a": 30})
    seeding.offer("b", 70, _copy(), 0.2)
    assert seeding.lost(seeding.seeds["a"]) is None
