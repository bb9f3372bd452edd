"""Every node of a running experiment lost: it waits, saying for what, and resumes from its newest checkpoint when nodes return."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossamer import Client
from gossamer.checkpoint.sharded import complete_steps
from tests._fixtures import MakeCluster
from tests.chaos._wait import assert_running, wait_event, wait_for

pytestmark = pytest.mark.timeout(300)

SLOW = {"GOSSAMER_FAULT": "delay:seconds=0.02"}


def test_all_nodes_killed_the_run_waits_then_resumes_from_its_newest_checkpoint_when_nodes_return(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        cluster.add_node("w0", spot=True, env=SLOW)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 2, 60, "nodes")
        job = client.submit({
            "name": "all-lost", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
            "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "ps_backup": False,
            "min_workers": 1, "max_workers": 1, "total_steps": 800, "eval_every": 0, "checkpoint_every": 100,
            "node_wait_timeout_s": 120,
        })
        root = tmp_path / "state" / "checkpoints" / job.id / "shards"
        wait_for(lambda: root.exists() and len(complete_steps(root)) >= 2, 120, "two checkpoints")
        cluster.kill_node("w0")
        cluster.kill_node("ps")
        at_kill = assert_running(job, "the kill of every node")
        # The two losses can be seen one at a time (w0's first, seen at load 17): wait for the
        # waiting event that follows both.
        waiting = wait_event(job, lambda e: e["kind"] == "waiting" and "host shard 0" in e["message"]
                             and "a node to run a worker" in e["message"], 60, "the waiting event for both")
        assert "waiting for a node to host shard 0" in waiting["message"], waiting
        assert "a node to run a worker" in waiting["message"], waiting
        st = job.status()
        assert st["state"] == "running" and st["message"] == waiting["message"], st
        newest = complete_steps(root)[0]
        # The returning shard host is slow to serve: the worker starts first and must wait for the
        # restored shard's endpoint (it used to fail 'no endpoint' until the run gave up).
        serve = tmp_path / "serve"  # the shard serves once the worker is seen waiting for it, however slow either is
        cluster.add_node("ps2", env={"GOSSAMER_FAULT": f"slow-start:until={serve}:seconds=180"})
        # ps2 first, alone: the coordinator hosts the shard on the first free node (a spot one too).
        wait_for(lambda: any(n["name"] == "ps2" for n in client.nodes()), 60, "ps2 to join")
        cluster.add_node("w1", spot=True, env=SLOW)
        wait_event(job, lambda e: e["kind"] == "resumed", 60, "the resumed event")
        wait_for(lambda: "not serving yet: waiting for their endpoints" in (cluster.log_dir / "w1.log").read_text(),
                 60, "the worker to wait for the restored shard")
        serve.touch()
        result = job.wait(timeout=240)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert result.metrics["steps"] >= 800, (result.metrics, text)
    restored = [e["message"] for e in events if e["kind"] == "restored"]
    # The last restore, on the returned node, read the newest checkpoint written before the loss.
    assert f"from {newest}" in restored[-1] or f"from {newest.resolve()}" in restored[-1], (restored, newest)
    lost = int(restored[-1].split("at least ")[1].split(" version")[0])
    assert result.metrics["versions_lost"] >= lost, (result.metrics, restored)
    assert result.metrics["restores"] >= 1 and at_kill["steps"] > 0, (result.metrics, at_kill)
