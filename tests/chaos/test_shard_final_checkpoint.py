"""A shard host with no backup stopped gracefully (SIGTERM): the shard's final checkpoint loses nothing acknowledged."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from gossamer import Client
from gossamer.checkpoint.sharded import step_dir
from tests._fixtures import MakeCluster
from tests.chaos._wait import assert_running, wait_event, wait_for, wait_steps

pytestmark = pytest.mark.timeout(300)

TOTAL = 1500
EVERY = 100
FINAL = re.compile(r"shard 0: final checkpoint at version (\d+) written")


def test_shard_host_without_backup_sigtermed_mid_run_is_restored_at_the_version_it_stopped_at(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        for name in ("w0", "w1"):  # spot: the shard stays on ps
            cluster.add_node(name, spot=True, env={"GOSSAMER_FAULT": "delay:seconds=0.02"})
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 3, 60, "nodes")
        job = client.submit({
            "name": "final-ckpt", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
            "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "ps_backup": False,
            "min_workers": 2, "max_workers": 2, "total_steps": TOTAL, "eval_every": 500, "checkpoint_every": EVERY,
        })
        root = tmp_path / "state" / "checkpoints" / job.id / "shards"
        wait_steps(job, TOTAL // 4, 180, "a quarter of the run")
        assert cluster.stop_node("ps", signal.SIGTERM, timeout=60) == 0  # the agent's graceful leave
        assert_running(job, "the SIGTERM of ps")
        log = (cluster.log_dir / "ps.log").read_text(errors="replace")
        final = FINAL.search(log)
        assert final is not None, log[-3000:]
        stopped_at = int(final.group(1))
        # Written under the periodic checkpoints' root (read now: later ones prune it), with the
        # shard's version and its workers' clocks.
        manifest = json.loads((step_dir(root, stopped_at) / "shard-000" / "manifest.json").read_text())
        assert manifest["version"] == stopped_at and manifest["extra"]["applied"], manifest
        wait_event(job, lambda e: e["kind"] == "leave" and e["message"].endswith("left: signal"), 60, "ps's Leave")
        cluster.add_node("ps2")  # the shard is restored here
        result = job.wait(timeout=240)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert stopped_at >= TOTAL // 4, stopped_at
    # Registered before the node left: the coordinator heard of it as the shard's newest checkpoint.
    kinds = [(e["kind"], e["message"]) for e in events]
    registered = next(i for i, (k, m) in enumerate(kinds)
                      if k == "checkpoint" and m.startswith(f"shard checkpoint at step {stopped_at}: "))
    assert registered < next(i for i, (k, _) in enumerate(kinds) if k == "leave"), text
    # Restored at exactly the version it stopped at: nothing it acknowledged is lost.
    (restored,) = [e["message"] for e in events if e["kind"] == "restored"]
    assert restored.startswith(f"shard 0 restored from {step_dir(root, stopped_at)} at version {stopped_at};"), restored
    assert "at least 0 version(s) lost" in restored, restored
    assert result.metrics["versions_lost"] == 0, (result.metrics, text)
    assert result.metrics["restores"] == 1
    assert result.metrics["eval_accuracy"] >= 0.9, result.metrics
