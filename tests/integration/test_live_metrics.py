"""`gossamer watch ID --tensorboard DIR` writes the run's points while it trains; `--wandb PROJECT` logs them to an offline W&B run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gossamer import Client
from gossamer.tools.export import run_dir
from gossamer.tools.local_cluster import LocalCluster
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import DIGITS, StartCoordinator, experiment
from tests.chaos._wait import assert_running, wait_for

pytestmark = pytest.mark.timeout(300)


def _watch(*args: str, env: dict[str, str] | None = None, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "gossamer.tools.cli", "watch", *args], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def wait_worker(job: Any) -> dict[str, Any]:
    """The status role of `job`'s worker, once it has one (the nodes it runs on are placement's choice)."""
    found: list[dict[str, Any]] = []
    wait_for(lambda: found.extend(r for r in job.status()["roles"] if r["role"] == "worker") or found, 120,
             "the worker's placement")
    return found[0]


def _loss_steps(run: Path) -> list[tuple[float, int, float]]:
    """The `loss` scalars of a TensorBoard run directory as tensorboard reads it, (wall time, step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    if not any(run.glob("events.out.tfevents.*")):
        return []
    acc = EventAccumulator(str(run), size_guidance={SCALARS: 0})
    acc.Reload()
    return [(e.wall_time, e.step, e.value) for e in acc.Scalars("loss")] if "loss" in acc.Tags()["scalars"] else []


def test_tensorboard_files_grow_while_the_run_trains(cluster: LocalCluster, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'gossamer[tensorboard]'")
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.add_node("w0")
    cluster.wait_joined("ps", "w0")
    out = tmp_path / "tb"
    with Client(address) as client:
        # Long enough never to end by itself: the test cancels it once it has seen the files grow.
        job = client.submit(experiment(num_ps_shards=1, ps_backup=False, min_workers=1, max_workers=1,
                                       total_steps=1_000_000, eval_every=50))
        watcher = _watch(job.id, "--tensorboard", str(out), "--quiet", "--interval", "0.2", "-c", address,
                         log=tmp_path / "watch.log")
        try:
            worker = wait_worker(job)
            run = out / job.id / run_dir(f"{worker['node_id']}/0", {worker["node_id"]: worker["node"]})
            wait_for(lambda: _loss_steps(run), 180, "the first loss scalars in the event files")
            first = _loss_steps(run)
            at_first = assert_running(job, "the first read of the event files")
            # The run goes on; the same files, read again, hold its newer steps.
            wait_for(lambda: job.status()["steps"] > at_first["steps"] + 20, 120, "20 more steps")
            wait_for(lambda: _loss_steps(run)[-1][1] > first[-1][1], 60, "newer steps in the event files")
            second = _loss_steps(run)
            assert_running(job, "the second read of the event files")
            assert len(second) > len(first) and second[:len(first)] == first
            job.cancel()
            assert watcher.wait(timeout=60) == 1, (tmp_path / "watch.log").read_text()  # cancelled
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait()
        reported = [(p["time_unix"], p["step"], p["loss"]) for p in job.metrics()
                    if p["source"] == f"{worker['node_id']}/0" and "loss" in p and math.isfinite(p["loss"])]
    written = _loss_steps(run)
    # Each point once, with the coordinator's step and time: the files are the stream watch and plot read.
    assert [(t, s) for t, s, _ in written] == [(t, s) for t, s, _ in reported][:len(written)]
    assert [v for *_, v in written] == pytest.approx([v for *_, v in reported][:len(written)], rel=1e-6)
    assert len(written) >= len(second)


def test_watch_again_appends_only_newer_points(start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'gossamer[tensorboard]'")
    coordinator = start_coordinator(check_imports=False)
    out = tmp_path / "tb"
    with Client(coordinator.address) as client, grpc.insecure_channel(coordinator.address) as channel:
        job = client.submit({"name": "again", **DIGITS, "num_ps_shards": 1, "min_workers": 8, "max_workers": 8})
        stub = pb_grpc.ExperimentServiceStub(channel)
        t0 = time.time() - 100

        def report(steps: range) -> None:
            stub.ReportMetrics(pb.ReportMetricsRequest(experiment_id=job.id, points=[
                pb.MetricPoint(time_unix=t0 + i, step=i, source="n1/0", values={"loss": 1.0 / (1 + i)}) for i in steps]),
                timeout=30)

        report(range(0, 10))
        job.cancel()  # a finished run: watch takes what is there and ends
        for _ in range(2):  # the second watch finds nothing newer
            res = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "watch", job.id, "-q", "--tensorboard",
                                  str(out), "-c", coordinator.address], capture_output=True, text=True, timeout=120)
            assert res.returncode == 1 and "cancelled" in res.stdout, res.stdout + res.stderr
        assert [s for _, s, _ in _loss_steps(out / job.id / "n1")] == list(range(10))
        report(range(10, 15))  # late points of the same source
        res = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "watch", job.id, "-q", "--tensorboard",
                              str(out), "-c", coordinator.address], capture_output=True, text=True, timeout=120)
        assert res.returncode == 1, res.stdout + res.stderr
    assert [s for _, s, _ in _loss_steps(out / job.id / "n1")] == list(range(15))


def test_wandb_offline_writes_the_run_with_every_source(start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'gossamer[wandb]'")
    coordinator = start_coordinator(check_imports=False)
    with Client(coordinator.address) as client, grpc.insecure_channel(coordinator.address) as channel:
        job = client.submit({"name": "wb", **DIGITS, "num_ps_shards": 1, "min_workers": 8, "max_workers": 8})
        t0 = time.time() - 60
        pb_grpc.ExperimentServiceStub(channel).ReportMetrics(pb.ReportMetricsRequest(experiment_id=job.id, points=[
            *(pb.MetricPoint(time_unix=t0 + i, step=i, source="n1/0", values={"loss": 2.0 / (1 + i)}) for i in range(20)),
            *(pb.MetricPoint(time_unix=t0 + i + 0.5, step=i, source="n2/ps0", values={"ps_updates": float(i)})
              for i in range(20))]), timeout=30)
        job.cancel()
        env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
               "WANDB_API_KEY": "", "HTTPS_PROXY": "http://127.0.0.1:9"}  # no network needed, none reachable
        res = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "watch", job.id, "-q", "--wandb", "gossamer-test",
                              "-c", coordinator.address], capture_output=True, text=True, timeout=180,
                             env={**os.environ, **env})
    assert res.returncode == 1 and "cancelled" in res.stdout, res.stdout + res.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, sorted(p.as_posix() for p in tmp_path.rglob("*"))
    data = runs[0].read_bytes()
    for key in (b"n1/loss", b"n1/step", b"n2/ps0/ps_updates", job.id.encode()):
        assert key in data, key
