"""`profile_steps`: a real run writes a loadable torch.profiler trace and the split of its step time."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossamer import Client, Experiment
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import MakeCluster

pytestmark = pytest.mark.timeout(420)


def _run(cluster: LocalCluster, exp: Experiment, nodes: list[str]) -> tuple[Client, str]:
    address = cluster.start_coordinator(port=0)
    for name in nodes:
        cluster.add_node(name, spot=name.startswith("w"))
    client = Client(address)
    deadline = time.monotonic() + 120
    while sum(n["state"] == "ready" for n in client.nodes()) < len(nodes):
        assert time.monotonic() < deadline, client.nodes()
        time.sleep(0.2)
    job = client.submit(exp)
    result = job.wait(timeout=240)
    assert result.status == "completed", result
    return client, job.id


def _check_profile(root: Path, exp_id: str, node: str, steps: int) -> dict[str, float]:
    out = root / "checkpoints" / exp_id / "profile" / node / "rank0"
    with gzip.open(out / "trace.json.gz", "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"compute", "communication"} <= names, sorted(n for n in names if n)[:50]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["node"] == node
    fractions = summary["fractions"]
    assert set(fractions) == {"compute", "compression", "communication", "other"}
    assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6)
    assert all(0.0 <= v <= 1.0 for v in fractions.values())
    assert fractions["compute"] > 0 and fractions["communication"] > 0
    assert summary["seconds"]["compute"] > 0 and summary["step_s"] > 0
    return fractions


def test_async_run_profiles_five_steps_of_its_worker(tmp_path: Path, make_cluster: MakeCluster) -> None:
    exp = Experiment(name="prof", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                     mode="async", num_ps_shards=1, ps_backup=False, min_workers=1, max_workers=1,
                     total_steps=200, eval_every=0, compression="int8", profile_steps=5, profile_start=10)
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client, exp_id = _run(cluster, exp, ["od0", "w0"])
        fractions = _check_profile(cluster.state_dir, exp_id, "w0", 5)
        assert fractions["compression"] > 0  # int8 encode of the pushed gradient
        # The split is in the experiment's metrics and in `gossamer status ID`.
        series = [p for p in client.job(exp_id).metrics() if "profile_compute_frac.w0" in p]
        assert series and series[0]["profile_compute_frac.w0"] == pytest.approx(fractions["compute"])
        assert client.job(exp_id).status()["metrics"]["profile_steps.w0"] == 5
        status = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "status", exp_id, "-c", cluster.address],
                                capture_output=True, text=True, timeout=60)
        assert "profile" in status.stdout and "communication" in status.stdout, status.stdout + status.stderr
        client.close()


def test_gossip_run_profiles_only_the_named_node(tmp_path: Path, make_cluster: MakeCluster) -> None:
    exp = Experiment(name="prof-g", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                     mode="gossip", min_workers=2, max_workers=2, total_steps=60, eval_every=0,
                     compression="int8", profile_steps=5, profile_start=5, profile_nodes=["w1"])
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client, exp_id = _run(cluster, exp, ["w0", "w1"])
        _check_profile(cluster.state_dir, exp_id, "w1", 5)
        assert not (cluster.state_dir / "checkpoints" / exp_id / "profile" / "w0").exists()
        client.close()
