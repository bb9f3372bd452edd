"""`gossamer export ID --tensorboard DIR` on a real run: the event files hold exactly the series the client reports."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossamer import Client
from gossamer.export import run_dir
from gossamer.local_cluster import LocalCluster
from tests._fixtures import experiment
from tests.unit.test_export_tensorboard import read_runs

pytest.importorskip("tensorboard")
pytestmark = pytest.mark.timeout(300)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gossamer.cli", *args], capture_output=True, text=True, timeout=120)


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
    assert again.returncode == 2 and "already holds TensorBoard event files" in again.stderr
    unknown = _cli("export", "no-such-exp", "--tensorboard", str(tmp_path / "x"), "-c", address)
    assert unknown.returncode == 2 and "no-such-exp" in unknown.stderr
    assert not (tmp_path / "x").exists()
