"""DiLoCo on real shards: H=20 local steps per round ends where sync mode ends, at a fraction of the bytes.

The outer momentum is 0.6 (the default), not the paper's 0.9: with AdamW's
inner steps 0.9 grows the weights on digits (measured: same accuracy band, eval loss 0.63
against 0.10; more rounds make it worse: docs/modes.md, DiLoCo).
"""

from __future__ import annotations

from typing import Any

import pytest

from gossamer.paramserver.shard import ShardConfig
from tests._fixtures import experiment
from tests.integration._ps_harness import run_async

pytestmark = pytest.mark.timeout(600)


#: The digits experiment of these tests (its mode and overrides per test).
DILOCO: dict[str, Any] = dict(name="d", num_ps_shards=2, total_steps=400, eval_every=0, ps_backup=False, seed=1)


def test_diloco_defaults_follow_the_paper_but_the_outer_momentum() -> None:
    exp = experiment(DILOCO, mode="diloco")
    assert (exp.optimizer, exp.compression, exp.inner_steps, exp.outer_lr, exp.outer_momentum) == \
        ("adamw", "int8", 20, 0.7, 0.6)
    cfg = ShardConfig.for_experiment(exp, "e", 0)
    assert cfg.optimizer.name == "sgd" and cfg.optimizer.nesterov and cfg.optimizer.lr == 0.7
    assert cfg.mode == "sync" and cfg.total_steps == 20  # 400 inner steps = 20 outer rounds
    asynchronous = ShardConfig.for_experiment(experiment(DILOCO, mode="diloco", outer_step="async"), "e", 0)
    assert asynchronous.staleness_in_rounds and asynchronous.optimizer.momentum == 0.6
    assert asynchronous.optimizer.delayed and not asynchronous.optimizer.nesterov  # Delayed Nesterov


def test_diloco_h20_matches_sync_accuracy_with_15x_fewer_bytes() -> None:
    sync = run_async(experiment(DILOCO, mode="sync", lr=0.05, momentum=0.9), workers=4)
    dl = run_async(experiment(DILOCO, mode="diloco", lr=0.003, inner_steps=20, outer_momentum=0.6), workers=4)
    sync_bytes = sync["bytes_up"] + sync["bytes_down"]  # type: ignore[operator]
    dl_bytes = dl["bytes_up"] + dl["bytes_down"]  # type: ignore[operator]
    print(f"sync {sync['accuracy']:.4f} {sync_bytes} B; diloco {dl['accuracy']:.4f} {dl_bytes} B "
          f"({sync_bytes / dl_bytes:.1f}x fewer)")
    assert dl["accuracy"] >= sync["accuracy"] - 0.01, (dl["accuracy"], sync["accuracy"])  # type: ignore[operator]
    assert sync_bytes / dl_bytes >= 15
    rounds = [t.rounds for t in dl["trainers"]]  # type: ignore[attr-defined]
    assert rounds == [20] * 4, rounds
    # ps_backup is off: acknowledging without a backup is what was asked, not a degraded run.
    assert all(s["unreplicated"] == 0 for s in dl["server_stats"]), dl["server_stats"]  # type: ignore[attr-defined]


def test_diloco_async_outer_step_trains() -> None:
    # Async outer step: total_steps counts every worker's inner steps (as async mode counts
    # every worker's updates): 4 workers x 400 steps.
    got = run_async(experiment(DILOCO, mode="diloco", lr=0.003, inner_steps=20, outer_momentum=0.6,
                               outer_step="async", total_steps=1600), workers=4)
    print(f"diloco async: {got['accuracy']:.4f}")
    assert got["accuracy"] >= 0.95


def test_diloco_sync_and_async_at_the_defaults_end_where_sync_mode_ends() -> None:
    # bench/modes.py's digits cell on 3 workers (400 steps each), every DiLoCo setting at its default.
    # Eval loss, not only accuracy (360 eval samples: one is 0.28 points): an outer
    # momentum of 0.9 grew the weights (in-process model, 12 seeds: eval loss 0.59 sync, 0.38 async,
    # against sync mode's 0.10) and the async outer step was a third of the sync one. Measured here:
    # sync mode 0.975 / 0.090; diloco/sync 0.983 / 0.097; diloco/async 0.969-0.981 / 0.10-0.12 (5 runs).
    sync = run_async(experiment(DILOCO, mode="sync", lr=0.05, momentum=0.9), workers=3)
    outer = {o: _median_run(experiment(DILOCO, mode="diloco", lr=0.003, outer_step=o,
                                       total_steps=400 * (3 if o == "async" else 1)), runs=3 if o == "async" else 1)
             for o in ("sync", "async")}
    print({"sync mode": (sync["accuracy"], sync["loss"]), **{f"diloco/{o}": r for o, r in outer.items()}})
    for r in outer.values():
        assert r["accuracy"] >= sync["accuracy"] - 0.01, (r, sync["accuracy"])  # type: ignore[operator]
        assert r["loss"] <= 2 * sync["loss"], (r, sync["loss"])  # type: ignore[operator]


def _median_run(exp: Any, runs: int) -> dict[str, Any]:
    """The median accuracy and loss of `runs` runs of `exp` (each run's figures kept under "runs").

    The async outer step applies each worker's round as it arrives, so where a round lands
    depends on how the worker threads were scheduled: quiet, 0.969-0.983 over 6 runs; beside
    six busy loops, 0.950-0.983 (2 of 6 more than a point below sync mode's 0.975). One run
    measures the scheduler as much as the algorithm; the median of three measures the algorithm.
    """
    got = [(float(g["accuracy"]), float(g["loss"])) for g in (run_async(exp, workers=3) for _ in range(runs))]  # type: ignore[arg-type]
    return {"accuracy": sorted(a for a, _ in got)[runs // 2], "loss": sorted(b for _, b in got)[runs // 2], "runs": got}
