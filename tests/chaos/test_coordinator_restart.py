"""kill -9 of the coordinator mid-experiment: training goes on, a restart on the same state resumes everything."""

from __future__ import annotations

import time

import pytest

from gossamer import Client
from gossamer.examples.digits import mlp
from gossamer.local_cluster import LocalCluster
from gossamer.paramserver import ShardClient, ShardPlan

pytestmark = pytest.mark.timeout(300)


def _shard_version(exp_id: str, endpoint: str) -> int:
    plan = ShardPlan.for_module(mlp(), 1)
    client = ShardClient(experiment=exp_id, sender="observer", plan=plan, endpoints={0: endpoint}, timeout_s=10)
    try:
        return int(client.stats(0)["version"])
    finally:
        client.close()


def test_coordinator_kill9_and_restart_on_same_state_dir(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    time.sleep(0.3)  # joined first: hosts the shard
    cluster.add_node("w0", spot=True)
    cluster.add_node("w1", spot=True)
    client = Client(address)
    deadline = time.monotonic() + 60
    while sum(n["state"] == "ready" for n in client.nodes()) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    job = client.submit({
        "name": "restart", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "min_workers": 2, "max_workers": 2,
        "total_steps": 4000, "eval_every": 200,
    })
    deadline = time.monotonic() + 90
    while (st := job.status())["steps"] < 200:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    endpoint = next(r["endpoint"] for r in st["roles"] if r["role"] == "ps")
    points_before = len(job.metrics())
    nodes_before = {n["id"]: n for n in client.nodes()}

    cluster.kill_coordinator()
    v1 = _shard_version(job.id, endpoint)
    time.sleep(3.0)
    v2 = _shard_version(job.id, endpoint)
    assert v2 > v1 + 50, f"training stalled while the coordinator was down ({v1} -> {v2})"

    cluster.start_coordinator()  # same port, same --state-dir
    st = job.status()
    assert st["state"] == "running" and st["steps"] >= 200
    assert len(job.metrics()) >= points_before
    nodes_after = {n["id"]: n for n in client.nodes()}
    assert nodes_after.keys() == nodes_before.keys()
    assert all(n["state"] == "busy" for n in nodes_after.values())

    result = job.wait(timeout=180)
    assert result.status == "completed", result.message
    assert result.metrics["steps"] == 4000
    assert result.metrics["eval_accuracy"] >= 0.9
    # Every node re-attached (heartbeats renewed its lease): none was declared lost.
    assert all(n["state"] == "ready" for n in client.nodes())
    client.close()
