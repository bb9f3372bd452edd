"""kill -9 of the coordinator mid-experiment: training goes on, a restart on the same state resumes everything."""

from __future__ import annotations

import time

import pytest

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests.chaos._coordinator_loss import shard_version, start_digits_run
from tests.chaos._wait import wait_steps

pytestmark = pytest.mark.timeout(300)


def test_coordinator_kill9_and_restart_on_same_state_dir(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    client = Client(address)
    job = start_digits_run(cluster, client, "restart")
    st = wait_steps(job, 200, 90, "200 steps")
    endpoint = next(r["endpoint"] for r in st["roles"] if r["role"] == "ps")
    points_before = len(job.metrics())
    nodes_before = {n["id"]: n for n in client.nodes()}

    cluster.kill_coordinator()
    v1 = shard_version(job.id, endpoint)
    # Training goes on without it: 50 more versions within 3 s (a fixed 3 s sleep before:
    # this returns as soon as they are applied).
    down_until = time.monotonic() + 3.0
    while (v2 := shard_version(job.id, endpoint)) <= v1 + 50 and time.monotonic() < down_until:
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
