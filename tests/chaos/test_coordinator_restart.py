"""kill -9 of the coordinator mid-experiment: training goes on, a restart on the same state resumes everything."""

from __future__ import annotations

import time

import pytest

from gossamer import Client
from gossamer.examples.digits import mlp
from gossamer.local_cluster import LocalCluster
from gossamer.paramserver import ShardClient, ShardPlan
from tests.chaos._wait import wait_for, wait_steps

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
    client = Client(address)
    cluster.add_node("ps")
    wait_for(lambda: len(client.nodes()) == 1, 60, "ps")  # joined first: hosts the shard
    cluster.add_node("w0", spot=True)
    cluster.add_node("w1", spot=True)
    wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 3, 60, "three nodes")
    job = client.submit({
        "name": "restart", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "min_workers": 2, "max_workers": 2,
        "total_steps": 4000, "eval_every": 200,
    })
    st = wait_steps(job, 200, 90, "200 steps")
    endpoint = next(r["endpoint"] for r in st["roles"] if r["role"] == "ps")
    points_before = len(job.metrics())
    nodes_before = {n["id"]: n for n in client.nodes()}

    cluster.kill_coordinator()
    v1 = _shard_version(job.id, endpoint)
    # Training goes on without it: 50 more versions within 3 s (a fixed 3 s sleep before:
    # this returns as soon as they are applied).
    down_until = time.monotonic() + 3.0
    while (v2 := _shard_version(job.id, endpoint)) <= v1 + 50 and time.monotonic() < down_until:
        time.sleep(0.05)
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
