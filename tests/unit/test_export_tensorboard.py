"""TensorBoard export: each source a run, each metric a tag, read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from gossamer.core.errors import GossamerError
from gossamer.tools.export import run_dir, write_tensorboard

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    SCALARS,
    EventAccumulator,
)


def _points() -> list[dict[str, Any]]:
    pts: list[dict[str, Any]] = []
    for t in range(20):
        for w in range(2):
            pts.append({"time_unix": 1000.0 + t + 0.1 * w, "step": t * 10, "source": f"node{w}/0",
                        "loss": 2.0 / (t + 1) + 0.01 * w, "samples_per_s": 100.0 + t})
        if t % 5 == 0:
            pts.append({"time_unix": 1000.0 + t + 0.5, "step": t * 10, "source": "node0/0",
                        "eval_loss": 1.0 / (t + 1), "eval_accuracy": math.nan if t == 5 else 0.5 + 0.02 * t})
        pts.append({"time_unix": 1000.0 + t + 0.7, "step": t * 10, "source": "node9/ps0", "updates": float(t)})
    return pts


def read_runs(root: Path) -> dict[str, dict[str, list[tuple[float, int, float]]]]:
    """Every run under `root` (a directory holding event files), as tag -> [(wall time, step, value)]."""
    runs: dict[str, dict[str, list[tuple[float, int, float]]]] = {}
    for events in sorted(root.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={SCALARS: 0})
        acc.Reload()
        run = events.parent.relative_to(root).as_posix()
        runs[run] = {tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return runs


def test_every_finite_value_is_a_scalar_of_its_source_run_with_its_step_and_time(tmp_path: Path) -> None:
    pts = _points()
    counts = write_tensorboard(pts, tmp_path, names={"node0": "spot-0"})
    runs = read_runs(tmp_path)
    assert sorted(runs) == ["node1", "node9/ps0", "spot-0"]
    assert sorted(runs["spot-0"]) == ["eval_accuracy", "eval_loss", "loss", "samples_per_s"]
    for source, run in (("node0/0", "spot-0"), ("node1/0", "node1"), ("node9/ps0", "node9/ps0")):
        n = 0
        for tag, got in runs[run].items():
            want = [(p["time_unix"], p["step"], p[tag]) for p in pts
                    if p["source"] == source and tag in p and math.isfinite(p[tag])]
            assert [(t, s) for t, s, _ in got] == [(t, s) for t, s, _ in want], (run, tag)
            assert [v for *_, v in got] == pytest.approx([v for *_, v in want], rel=1e-6), (run, tag)
            n += len(got)
        assert counts[run] == n
    # The NaN accuracy is left out, its neighbours are there.
    assert [s for _, s, _ in runs["spot-0"]["eval_accuracy"]] == [0, 100, 150]


def test_a_second_export_into_the_same_directory_is_refused(tmp_path: Path) -> None:
    write_tensorboard(_points(), tmp_path)
    with pytest.raises(GossamerError, match="already holds TensorBoard event files"):
        write_tensorboard(_points(), tmp_path)


def test_run_directories_are_safe_names_under_the_experiment() -> None:
    assert run_dir("abc/1", {"abc": "../x y"}) == Path("_x_y") / "1"
    assert run_dir("abc/0") == Path("abc")
    assert run_dir("n/ps2", {"n": "shard-host"}) == Path("shard-host") / "ps2"


def test_merged_points_give_their_mean_at_their_step_and_their_extremes_as_own_tags(tmp_path: Path) -> None:
    # Old points merged by the coordinator's retention, then points as reported: one series runs on.
    pts: list[dict[str, Any]] = [
        {"time_unix": 1000.0, "step": 10, "source": "n/0", "loss": 2.0, "count": 5,
         "min": {"loss": 1.5}, "max": {"loss": 3.0}},
        {"time_unix": 1060.0, "step": 20, "source": "n/0", "loss": 1.0, "samples_per_s": math.inf, "count": 4,
         "min": {"loss": 0.5, "samples_per_s": 9.0}, "max": {"loss": math.nan, "samples_per_s": math.inf}},
        {"time_unix": 1061.0, "step": 21, "source": "n/0", "loss": 0.75},
    ]
    counts = write_tensorboard(pts, tmp_path)
    runs = read_runs(tmp_path)
    assert runs["n"] == {
        "loss": [(1000.0, 10, 2.0), (1060.0, 20, 1.0), (1061.0, 21, 0.75)],
        "loss/min": [(1000.0, 10, 1.5), (1060.0, 20, 0.5)],
        "loss/max": [(1000.0, 10, 3.0)],  # non-finite extremes are left out as values are
        "samples_per_s/min": [(1060.0, 20, 9.0)],
    }
    assert counts == {"n": 7}
