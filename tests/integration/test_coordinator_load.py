"""The load generator (bench/coordinator_load.py) at a small scale: every simulated node is served and none is lost."""

from __future__ import annotations

from pathlib import Path

from bench.coordinator_load import run_point


def test_fifty_simulated_nodes_with_experiments_are_all_served_and_none_is_lost(tmp_path: Path) -> None:
    row = run_point(50, loaders=1, warm_s=1.0, measure_s=4.0, pin=False, workdir=tmp_path, experiments=5)
    assert row["lost"] == 0
    assert row["unknown_hb"] == 0
    assert row["experiments_running"] == 5
    assert row["hb_per_s"] > 0 and row["p99_ms"] > 0


def test_a_kill_9_of_the_coordinator_under_load_loses_no_acknowledged_node_or_experiment(tmp_path: Path) -> None:
    row = run_point(40, loaders=1, warm_s=1.0, measure_s=6.0, pin=False, workdir=tmp_path, experiments=3,
                    churn_per_min=120.0, kill9=True)
    assert row["nodes_before"] >= 40
    assert row["nodes_missing_after"] == 0
    assert row["experiments_changed_after"] == 0
    assert row["lost"] == 0
