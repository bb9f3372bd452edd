"""A completed run's final counters are exact: the run completes once every worker's final counts are in.

A worker late with its final report (held at the exact spot, as a loaded machine delays it)
holds the completion back; a worker killed before it does not, and the result says whose
counts are missing instead of under-counting silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster
from tests.chaos._wait import wait_for

pytestmark = pytest.mark.timeout(300)

TOTAL, BATCH = 40, 16
RUN = {
    "name": "final-counts", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
    "mode": "sync", "lr": 0.05, "num_ps_shards": 1, "ps_backup": False, "batch_size": BATCH,
    "min_workers": 3, "max_workers": 3, "total_steps": TOTAL, "eval_every": 0,
}
#: Worker 1 reports its final counts 3 s late (the lead completes meanwhile); worker 2 dies before.
FAULTS = {"w0": "", "w1": "hold:at=final-report:seconds=3:worker=1", "w2": "die:at=final-report:worker=2"}


def _counts_at(series: list[dict[str, Any]], source: str, until: float) -> dict[str, Any]:
    """The newest point of `source` carrying samples, created by `until`."""
    points = [p for p in series if p["source"] == source and "samples" in p and p["time_unix"] <= until]
    return points[-1] if points else {}


def test_completion_waits_for_a_late_final_report_and_names_a_dead_workers_missing_counts(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        for name, fault in FAULTS.items():  # joined in order: w0 is worker 0, the lead
            # `once`: a file the die fault leaves when it fires, so the test knows it did.
            fault = f"{fault}:once={tmp_path / name}" if fault.startswith("die:") else fault
            cluster.add_node(name, spot=True, env={"GOSSAMER_FAULT": fault})
            cluster.wait_joined(name)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 60, "nodes")
        job = client.submit(RUN)
        result = job.wait(timeout=240)
        st = job.status()
        series = job.metrics()
        events = job.events()
        client.close()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert (tmp_path / "w2").exists(), ("the die fault did not fire", st["roles"], text)
    workers = {r["node"]: r["node_id"] for r in st["roles"] if r["role"] == "worker"}
    assert {"w0", "w1"} <= set(workers), st["roles"]
    # What the run said at completion: every sample of the lead and of the late worker, exactly.
    for name in ("w0", "w1"):
        counts = _counts_at(series, f"{workers[name]}/0", st["finished_unix"])
        assert (counts.get("samples"), counts.get("updates")) == (TOTAL * BATCH, TOTAL), (name, counts, text)
    assert result.metrics["samples"] >= 2 * TOTAL * BATCH, result.metrics
    # The dead worker's last counts are missing, and the result says so.
    assert result.metrics.get("final_reports_missing") == 1, (result.metrics, text)
    assert "final counts of 1 worker(s) missing" in result.message, result.message
    assert any(e["kind"] == "incomplete-metrics" and "worker 2 on w2" in e["message"] for e in events), text
