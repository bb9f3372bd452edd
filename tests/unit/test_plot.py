"""`gossamer plot`'s figure: four panels with data, totals summed over sources, a real PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossamer.core.errors import GossamerError
from gossamer.tools.plot import plot_to_file, render, summed_latest


def _points(workers: int = 2, seconds: int = 10) -> list[dict[str, object]]:
    pts: list[dict[str, object]] = []
    for t in range(seconds):
        for w in range(workers):
            pts.append({"time_unix": 1000.0 + t + 0.1 * w, "step": t * 10, "source": f"node{w}/0",
                        "loss": 2.0 / (t + 1), "samples_per_s": 100.0, "bytes_up": 1e6 * (t + 1),
                        "bytes_down": 2e6 * (t + 1), "updates": float(t * 10)})
        if t % 3 == 0:
            pts.append({"time_unix": 1000.0 + t + 0.5, "step": t * 10, "source": "node0/0",
                        "eval_accuracy": 0.5 + 0.04 * t, "eval_loss": 1.0 / (t + 1), "eval_step": float(t * 10)})
    return pts


def test_render_draws_four_panels_each_with_a_line_of_several_points() -> None:
    fig = render(_points(), title="exp-1", names={"node0": "spot-0"})
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["loss", "eval accuracy", "throughput", "bytes, cumulative"]
    for ax in axes:
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) >= 2]  # type: ignore[arg-type]
        assert lines, f"panel {ax.get_title()!r} has no line with 2+ points"
    labels = axes[0].get_legend_handles_labels()[1]
    assert "train spot-0" in labels and "train node1" in labels and "eval" in labels


def test_throughput_and_bytes_are_summed_over_workers() -> None:
    pts = _points(workers=3, seconds=4)
    _, rate = summed_latest(pts, "samples_per_s", 1000.0, ttl_s=5.0)
    assert rate[-1] == pytest.approx(300.0)
    _, up = summed_latest(pts, "bytes_up", 1000.0)
    assert up[-1] == pytest.approx(3 * 4e6)
    assert up == sorted(up)  # cumulative: never goes down


def test_a_worker_that_stopped_reporting_leaves_the_throughput() -> None:
    pts = [{"time_unix": 0.0, "source": "a/0", "samples_per_s": 50.0},
           {"time_unix": 1.0, "source": "b/0", "samples_per_s": 70.0},
           {"time_unix": 20.0, "source": "b/0", "samples_per_s": 70.0}]
    _, rate = summed_latest(pts, "samples_per_s", 0.0, ttl_s=5.0)
    assert rate == [50.0, 120.0, 70.0]


def test_panels_without_data_say_so_and_no_points_is_an_error() -> None:
    fig = render([{"time_unix": 1.0, "step": 1, "source": "n/0", "loss": 1.0},
                  {"time_unix": 2.0, "step": 2, "source": "n/0", "loss": 0.9}])
    acc = fig.get_axes()[1]
    assert any(t.get_text() == "no data yet" for t in acc.texts)
    with pytest.raises(GossamerError, match="no metric points"):
        render([])


def test_plot_to_file_writes_a_png(tmp_path: Path) -> None:
    out = plot_to_file(_points(), tmp_path / "sub" / "x.png", title="t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
