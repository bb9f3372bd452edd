"""Gossip through real processes while a worker is killed and a new machine joins: training goes on.

The dead worker's neighbours fold back the mass they had sent it once the coordinator
removes it (a new generation resets every weight to 1); the new worker starts from the
parameters and step of the most advanced peer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster
from tests.chaos._wait import assert_running, wait_for, wait_steps

pytestmark = pytest.mark.timeout(300)


def test_gossip_survives_a_kill_and_a_join(tmp_path: Path, make_cluster: MakeCluster) -> None:
    spec = {
        "name": "gossip-churn", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "gossip", "lr": 0.05, "momentum": 0.9, "min_workers": 3, "max_workers": 4,
        "total_steps": 1000, "eval_every": 0,
    }
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        slow = {"GOSSAMER_FAULT": "delay:seconds=0.04"}  # the newcomer starts (seconds) well before the end
        for i in range(4):
            cluster.add_node(f"w{i}", spot=True, env=slow)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 90, "nodes")
        job = client.submit(spec)
        wait_steps(job, 100, 120, "100 steps")
        lead = next(r["node"] for r in job.status()["roles"] if r["role"] == "worker")  # the lead: keep it
        victim = next(f"w{i}" for i in range(4) if f"w{i}" != lead)
        cluster.kill_node(victim)
        assert_running(job, f"the kill of {victim}")
        wait_for(lambda: any(e["kind"] == "lost" for e in job.events()), 60, "the loss detected")
        cluster.add_node("w-new", spot=True, env=slow)
        assert_running(job, "the join of w-new")
        result = job.wait(timeout=240)
        events = job.events()
        history = job.metrics()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert any(e["kind"] == "lost" and f"node {victim} " in e["message"] for e in events), text
    assert any(e["kind"] == "reassign" and "node w-new joins as worker" in e["message"] for e in events), text
    joined = [p["joined_at_step"] for p in history if "joined_at_step" in p]
    assert any(j >= 100 for j in joined), joined  # the newcomer copied an advanced peer
    assert result.metrics["eval_accuracy"] >= 0.95, result.metrics
