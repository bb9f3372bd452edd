"""The profiler option: validated fields, the step window, exclusive region times, trace and summary files."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
import torch

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.engine.profiling import StepProfiler, profiles_node

BASE: dict[str, object] = dict(name="p", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                               total_steps=100)


@pytest.mark.parametrize(("fields", "bad"), [
    ({"profile_steps": -1}, "profile_steps"),
    ({"profile_steps": 5, "profile_start": -2}, "profile_start"),
    ({"profile_steps": 5, "profile_start": 96}, "profile_steps"),
    ({"profile_steps": True}, "profile_steps"),
    ({"profile_nodes": ["a"]}, "profile_nodes"),
    ({"profile_steps": 5, "profile_nodes": "a"}, "profile_nodes"),
    ({"profile_steps": 5, "profile_nodes": [""]}, "profile_nodes"),
])
def test_bad_profile_fields_are_refused_by_name(fields: dict[str, object], bad: str) -> None:
    with pytest.raises(ConfigError) as e:
        Experiment(**{**BASE, **fields})  # type: ignore[arg-type]
    assert e.value.field == bad


def test_profile_nodes_pick_nodes_by_name_or_id_and_empty_means_every_worker() -> None:
    every = Experiment(**{**BASE, "profile_steps": 3})  # type: ignore[arg-type]
    named = Experiment(**{**BASE, "profile_steps": 3, "profile_nodes": ["spot-1", "abc123"]})  # type: ignore[arg-type]
    assert profiles_node(every, "x", "anything")
    assert profiles_node(named, "zzz", "spot-1") and profiles_node(named, "abc123", "")
    assert not profiles_node(named, "zzz", "spot-2")
    assert not profiles_node(Experiment(**BASE), "x", "y")  # type: ignore[arg-type]
    assert Experiment.from_json(named.to_json()) == named


class _Codec:
    def encode(self, n: int) -> int:
        time.sleep(0.002)
        return n


def test_window_records_n_steps_with_exclusive_region_times(tmp_path: Path) -> None:
    exp = Experiment(**{**BASE, "profile_steps": 4, "profile_start": 2})  # type: ignore[arg-type]
    reported: list[tuple[int, dict[str, float]]] = []
    prof = StepProfiler(exp, experiment_id="e1", node_id="id1", node_name="n1", local_rank=0,
                        device=torch.device("cpu"), checkpoint_dir=str(tmp_path),
                        on_metrics=lambda s, v: reported.append((s, v)))
    codec = _Codec()
    prof.watch(codec, "encode")
    x = torch.randn(64, 64)
    comm_wall = 0.0  # the communication regions' wall time inside the window, as this test measures it
    for clock in range(10):
        prof.step(clock)
        assert prof.active == (2 <= clock < 6)
        with prof.region("compute"):
            (x @ x).sum().item()
            time.sleep(0.004)
        t0 = time.perf_counter()
        with prof.region("communication"):
            codec.encode(1)  # inside the exchange: counted as compression only
            time.sleep(0.003)
        comm_wall += (time.perf_counter() - t0) if prof.active else 0.0
        time.sleep(0.001)  # other
    prof.close(10)
    assert "encode" not in vars(codec)  # unpatched after the window

    out = tmp_path / "e1" / "profile" / "n1" / "rank0"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["first_step"] == 2
    fr, sec = summary["fractions"], summary["seconds"]
    assert set(fr) == {"compute", "compression", "communication", "other"}
    assert sum(fr.values()) == pytest.approx(1.0)
    assert all(0.0 <= v <= 1.0 for v in fr.values())
    assert sec["compute"] >= 4 * 0.004 and sec["compression"] >= 4 * 0.002
    # Exclusive: the encode inside the exchange counts once, as compression. The test's own clock
    # around each exchange contains both (a bound on measured time, not on sleep lengths, which a
    # loaded machine stretches at will); counted twice, the sum would exceed it by the 8 ms of encodes.
    assert sec["communication"] >= 4 * 0.003
    assert sec["communication"] + sec["compression"] <= comm_wall
    assert sec["other"] >= 4 * 0.001
    with gzip.open(out / "trace.json.gz", "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"compute", "communication", "compression"} <= names
    step, values = reported[-1]
    assert step == 6 and values["profile_steps.n1"] == 4.0
    assert values["profile_compute_frac.n1"] == pytest.approx(fr["compute"])


def test_a_run_ending_inside_the_window_exports_what_it_has(tmp_path: Path) -> None:
    exp = Experiment(**{**BASE, "profile_steps": 50, "profile_start": 0})  # type: ignore[arg-type]
    prof = StepProfiler(exp, experiment_id="e2", node_id="id2", node_name="", local_rank=1,
                        device=torch.device("cpu"), checkpoint_dir=str(tmp_path), on_metrics=lambda s, v: None)
    for clock in range(3):
        prof.step(clock)
        with prof.region("compute"):
            time.sleep(0.001)
    prof.close(3)
    summary = json.loads((tmp_path / "e2" / "profile" / "id2" / "rank1" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["node"] == "id2"


def test_an_unchosen_node_records_nothing(tmp_path: Path) -> None:
    exp = Experiment(**{**BASE, "profile_steps": 2, "profile_nodes": ["other"]})  # type: ignore[arg-type]
    prof = StepProfiler(exp, experiment_id="e3", node_id="id3", node_name="me", local_rank=0,
                        device=torch.device("cpu"), checkpoint_dir=str(tmp_path), on_metrics=lambda s, v: None)
    for clock in range(10):
        prof.step(clock)
        assert not prof.active
    prof.close(10)
    assert not (tmp_path / "e3").exists()
