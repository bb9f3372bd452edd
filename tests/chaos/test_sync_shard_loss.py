"""Sync mode, a shard with no backup lost: every shard rolls back to the same checkpoint and BSP goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster
from tests.chaos._wait import assert_running, wait_for, wait_steps

pytestmark = pytest.mark.timeout(300)


def test_sync_shard_loss_rolls_all_shards_back_together(tmp_path: Path, make_cluster: MakeCluster) -> None:
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps0")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps0")
        cluster.add_node("ps1")
        wait_for(lambda: len(client.nodes()) == 2, 60, "ps1")
        slow = {"GOSSAMER_FAULT": "delay:seconds=0.02"}
        for name in ("w0", "w1"):
            cluster.add_node(name, spot=True, env=slow)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 60, "nodes")
        job = client.submit({
            "name": "sync-loss", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
            "mode": "sync", "lr": 0.1, "momentum": 0.9, "global_batch_size": 64, "num_ps_shards": 2,
            "ps_backup": False, "min_workers": 2, "max_workers": 2, "total_steps": 600, "eval_every": 0,
            "checkpoint_every": 100,
        })
        wait_steps(job, 250, 120, "250 steps")
        cluster.kill_node("ps1")
        assert_running(job, "the kill of ps1")
        result = job.wait(timeout=240)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert result.metrics["eval_accuracy"] >= 0.9, (result.metrics, text)
    assert any(e["kind"] == "restore" and "shards [0, 1] roll back" in e["message"] for e in events), text
    restored = [e["message"] for e in events if e["kind"] == "restored"]
    steps = {m.split(" restored from ")[1].split(" at version")[0] for m in restored}
    assert len(restored) == 2 and len(steps) == 1, restored  # both shards, the same checkpoint
