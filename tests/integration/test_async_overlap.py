"""Async with overlap: the push of step t travels while step t+1 computes; one step staler, still converges."""

from __future__ import annotations

from typing import Any

import pytest

from gossamer import ConfigError
from tests._fixtures import experiment
from tests.integration._ps_harness import run_async

pytestmark = pytest.mark.timeout(300)


#: The digits experiment of these tests (overrides per test).
OVERLAP: dict[str, Any] = dict(name="overlap", mode="async", overlap=True, lr=0.05, momentum=0.9, num_ps_shards=2,
                               total_steps=1500, eval_every=0)


def test_single_worker_overlap_makes_every_update_exactly_one_step_stale() -> None:
    got = run_async(experiment(OVERLAP, total_steps=300), workers=1)
    for stats in got["server_stats"]:
        hist = {int(k): v for k, v in stats["version_staleness"].items()}
        assert hist == {0: 1, 1: 299}, hist  # the first push is fresh, every later one a step late


def test_overlapped_async_digits_reaches_95_percent() -> None:
    # Three threads interleave their pushes differently on every run, which moves the result:
    # at 1500 steps it measured 0.944-0.978 (one CI-blocking 0.944); at 2500, five runs gave
    # 0.967-0.981. The bound stays 0.95; the run is long enough to clear it every time.
    got = run_async(experiment(OVERLAP, total_steps=2500), workers=3)
    assert got["accuracy"] >= 0.95


def test_overlap_is_refused_in_sync_mode() -> None:
    with pytest.raises(ConfigError, match="overlap"):
        experiment(OVERLAP, mode="sync")
