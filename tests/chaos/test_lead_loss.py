"""The lead worker lost at the end of a run: whichever worker is lead then takes the final evaluation and checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import MakeCluster
from tests.chaos._wait import assert_running, wait_for

pytestmark = pytest.mark.timeout(300)

TOTAL = 600
#: Each worker's step takes 100 ms or more: the last 20% of the run lasts 4 s or more, several of the
#: workers' 1 s metric reports, so the kill lands mid-run (at 50 ms and 90% the status lagged the run
#: by more than its last second under two parallel test files, and the kill came after completion).
SLOW = {"GOSSAMER_FAULT": "delay:seconds=0.1"}
RUN = {
    "name": "lead-loss", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
    "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "ps_backup": False,
    "min_workers": 3, "max_workers": 3, "total_steps": TOTAL, "eval_every": 0,
}


def _start(cluster: LocalCluster, lead_fault: str = "") -> Client:
    client = Client(cluster.start_coordinator(port=0))
    cluster.add_node("ps")
    wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
    # Joined in order, so w0 is worker 0: the lead (the lowest-indexed worker).
    for name in ("w0", "w1", "w2"):
        fault = ",".join(f for f in (SLOW["GOSSAMER_FAULT"], lead_fault if name == "w0" else "") if f)
        cluster.add_node(name, spot=True, env={"GOSSAMER_FAULT": fault})
        cluster.wait_joined(name)
    wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 60, "nodes")
    return client


def _lead_name(status: dict[str, Any]) -> str:
    workers = sorted((r for r in status["roles"] if r["role"] == "worker"), key=lambda r: r["index"])
    return str(workers[0]["node"])


def test_lead_node_killed_near_the_end_another_worker_completes_the_run(tmp_path: Path,
                                                                        make_cluster: MakeCluster) -> None:
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = _start(cluster)
        job = client.submit(RUN)
        wait_for(lambda: job.status()["state"] == "running", 120, "running")
        assert _lead_name(job.status()) == "w0"
        wait_for(lambda: job.status()["steps"] >= 0.8 * TOTAL, 180, "80% of the steps", interval=0.05)
        cluster.kill_node("w0")
        assert_running(job, "the kill of the lead's node")
        result = job.wait(timeout=180)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert result.metrics["steps"] >= TOTAL, (result.metrics, text)
    assert 0.0 < result.metrics["eval_accuracy"] <= 1.0, result.metrics
    assert result.checkpoint and Path(result.checkpoint).exists(), result
    assert any(e["kind"] == "lost" and "w0" in e["message"] for e in events), text


def test_lead_dying_after_the_last_step_is_replaced_and_the_new_lead_finishes(tmp_path: Path,
                                                                             make_cluster: MakeCluster) -> None:
    # The lead's process SIGKILLs itself once past the last step, before its final evaluation:
    # every other worker has already reached the end, so only one that stayed can finish.
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = _start(cluster, "die:at=before-finish:worker=0")
        job = client.submit(RUN)
        result = job.wait(timeout=240)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert any(e["kind"] == "lost" and "worker 0" in e["message"] and "failed" in e["message"] for e in events), text
    assert result.metrics["steps"] >= TOTAL, (result.metrics, text)
    assert result.checkpoint and Path(result.checkpoint).exists(), result
