"""Runs of a user's sync loop against one plain process of it: the same parameters (within 1e-5), and trained."""

from __future__ import annotations

import itertools
from typing import Any

import torch

import gossamer
from gossamer.core.experiment import Experiment
from gossamer.examples.digits import mlp


def assert_sync_runs_equal_plain(states: dict[str, dict[str, torch.Tensor]], train: str, total: int,
                                 fields: dict[str, Any]) -> None:
    """Every run's final state (by name), and `gossamer.run_local` of `train`, pairwise within 1e-5; it trained."""
    plain = gossamer.run_local(Experiment(name="plain", train=train, mode="sync", total_steps=total, **fields))
    named = {**states, "plain": plain}
    assert all(set(state) == set(plain) for state in states.values())
    gaps = {f"{a}-{b}": max((named[a][k] - named[b][k]).abs().max().item() for k in plain)
            for a, b in itertools.combinations(named, 2)}
    assert all(gap <= 1e-5 for gap in gaps.values()), gaps
    assert max((plain[k] - mlp(hidden=64).state_dict()[k]).abs().max().item() for k in plain) > 1e-2  # it trained
