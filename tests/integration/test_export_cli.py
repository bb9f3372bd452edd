"""`gossamer export ID --tensorboard DIR` on a real run, and past the point limit: the event files hold exactly the series the client reports."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from gossamer import Client
from gossamer.coordinator.metric_query import DEFAULT_MAX_POINTS
from gossamer.tools.export import run_dir
from gossamer.tools.local_cluster import LocalCluster
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import DIGITS, StartCoordinator, experiment
from tests.unit.test_export_tensorboard import read_runs

pytest.importorskip("tensorboard")
pytestmark = pytest.mark.timeout(300)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *args], capture_output=True, text=True, timeout=120)


def test_export_writes_every_reported_series_as_tensorboard_scalars(cluster: LocalCluster, tmp_path: Path) -> None:
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.wait_joined("ps")
    cluster.add_node("w0", spot=True)
    client = Client(address)
    try:
        deadline = time.monotonic() + 60
        while sum(n["state"] == "ready" for n in client.nodes()) < 2:
            assert time.monotonic() < deadline, client.nodes()
            time.sleep(0.2)
        job = client.submit(experiment(num_ps_shards=1, ps_backup=False, min_workers=1, max_workers=1,
                                       total_steps=300, eval_every=100))
        assert job.wait(timeout=240).status == "completed"
        out = tmp_path / "tb"
        res = _cli("export", job.id, "--tensorboard", str(out), "-c", address)
        assert res.returncode == 0, res.stdout + res.stderr
        points = job.metrics()
        names = {r["node_id"]: r["node"] for r in job.status()["roles"] if r.get("node")}
    finally:
        client.close()

    runs = read_runs(out / job.id)
    sources = {p["source"] for p in points}
    assert sorted(runs) == sorted(run_dir(s, names).as_posix() for s in sources)
    assert "w0" in runs and any(r.startswith("ps/ps") for r in runs), sorted(runs)
    assert {"loss", "eval_loss", "eval_accuracy", "samples_per_s", "bytes_up"} <= set(runs["w0"]), sorted(runs["w0"])
    total = 0
    for source in sources:
        run = runs[run_dir(source, names).as_posix()]
        keys = {k for p in points if p["source"] == source for k in p} - {"time_unix", "step", "source"}
        assert set(run) == {k for k in keys if any(math.isfinite(p.get(k, math.nan)) for p in points)}
        for tag, got in run.items():
            want = [(p["time_unix"], p["step"], p[tag]) for p in points
                    if p["source"] == source and tag in p and math.isfinite(p[tag])]
            assert [(t, s) for t, s, _ in got] == [(t, s) for t, s, _ in want], (source, tag)
            assert [v for *_, v in got] == pytest.approx([v for *_, v in want], rel=1e-6), (source, tag)
            total += len(got)
    assert f"wrote {total} scalars in {len(runs)} runs" in res.stdout

    again = _cli("export", job.id, "--tensorboard", str(out), "-c", address)
    assert again.returncode == 1 and "already holds TensorBoard event files" in again.stderr
    unknown = _cli("export", "no-such-exp", "--tensorboard", str(tmp_path / "x"), "-c", address)
    assert unknown.returncode == 1 and "no-such-exp" in unknown.stderr
    assert not (tmp_path / "x").exists()


def test_a_run_past_the_point_limit_exports_its_merged_points_with_their_extremes(
        start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    """More points than one answer holds come merged per source: each tag is the bucket's mean at its
    last step and time, TAG/min and TAG/max its extremes; nothing reported is lost from the envelope."""
    coordinator = start_coordinator(check_imports=False)
    per_source, sources = 6000, ("a/0", "b/ps0")  # 4 a second each: 12,000 points, 2 or 3 a bucket
    assert per_source * len(sources) > DEFAULT_MAX_POINTS
    reported: dict[str, list[float]] = {s: [] for s in sources}
    with Client(coordinator.address) as client, grpc.insecure_channel(coordinator.address) as channel:
        job = client.submit({"name": "long", **DIGITS, "num_ps_shards": 1, "min_workers": 8, "max_workers": 8})
        stub = pb_grpc.ExperimentServiceStub(channel)
        t0 = time.time() - per_source / 4
        for start in range(0, per_source, 500):
            batch = []
            for i in range(start, min(start + 500, per_source)):
                for k, source in enumerate(sources):
                    loss = 3.0 / (1 + i / 100) + (0.5 if i % 7 == 0 else 0.0) + k
                    reported[source].append(loss)
                    values = {"loss": loss, **({"eval_loss": loss / 2} if i % 50 == 0 else {})}
                    batch.append(pb.MetricPoint(time_unix=t0 + i / 4 + 0.1 * k, step=i, source=source, values=values))
            stub.ReportMetrics(pb.ReportMetricsRequest(experiment_id=job.id, points=batch), timeout=30)
        out = tmp_path / "tb"
        res = _cli("export", job.id, "--tensorboard", str(out), "-c", coordinator.address)
        assert res.returncode == 0, res.stdout + res.stderr
        points = job.metrics()

    merged = sum("count" in p for p in points)  # a bucket that caught one point is that point
    assert len(points) <= DEFAULT_MAX_POINTS and merged > len(points) / 2, (len(points), merged)
    assert f"{merged} points came merged per source into time buckets" in res.stdout, res.stdout
    runs = read_runs(out / job.id)
    assert sorted(runs) == sorted(run_dir(s).as_posix() for s in sources)
    total = 0
    for source in sources:
        run = runs[run_dir(source).as_posix()]
        mine = [p for p in points if p["source"] == source]
        assert set(run) == {"loss", "loss/min", "loss/max", "eval_loss", "eval_loss/min", "eval_loss/max"}, sorted(run)
        for tag, got in run.items():
            key, _, bound = tag.partition("/")
            want = [(p["time_unix"], p["step"], p[bound][key] if bound else p[key]) for p in mine
                    if key in p and (not bound or "count" in p)]
            assert [(t, s) for t, s, _ in got] == [(t, s) for t, s, _ in want], (source, tag)
            assert [v for *_, v in got] == pytest.approx([v for *_, v in want], rel=1e-6), (source, tag)
            total += len(got)
        # The buckets stand for every reported point: their counts add up, their extremes are the series'.
        assert sum(p.get("count", 1) for p in mine) == per_source
        lows = [v for *_, v in run["loss/min"] + run["loss"]]
        assert min(lows) == pytest.approx(min(reported[source]), rel=1e-6)
        assert max(v for *_, v in run["loss/max"] + run["loss"]) == pytest.approx(max(reported[source]), rel=1e-6)
        assert run["loss"][-1][1] == per_source - 1  # the last bucket sits at the last step reported
    assert f"wrote {total} scalars in {len(runs)} runs" in res.stdout
