"""Live metric sinks: a missing package names its extra; the TensorBoard sink's files are readable at once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gossamer.core.errors import MissingExtraError
from gossamer.tools.live_metrics import TensorBoardSink, WandbSink


def test_a_missing_wandb_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    with pytest.raises(MissingExtraError, match=r"gossamer\[wandb\]") as e:
        WandbSink("p", "exp-1")
    assert e.value.extra == "wandb"


def test_a_missing_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(MissingExtraError, match=r"gossamer\[tensorboard\]"):
        TensorBoardSink(tmp_path, "exp-1")


def test_each_write_is_on_disk_before_the_sink_closes(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'gossamer[tensorboard]'")
    from tests.unit.test_export_tensorboard import read_runs

    sink = TensorBoardSink(tmp_path, "exp-1")
    try:
        for step in range(3):
            sink.write([{"time_unix": 1000.0 + step, "step": step, "source": "n1/0", "loss": 1.0 / (step + 1)}],
                       {"n1": "node-a"})
            assert [s for _, s, _ in read_runs(tmp_path / "exp-1")["node-a"]["loss"]] == list(range(step + 1))
    finally:
        sink.close()
