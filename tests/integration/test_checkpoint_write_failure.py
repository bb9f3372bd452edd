"""A shard's failing checkpoint writes reach the coordinator: an event with the error, and `gossamer status`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster
from tests.chaos._wait import wait_event, wait_for

pytestmark = pytest.mark.timeout(300)


def test_checkpoint_write_failure_is_an_event_and_shows_in_status(tmp_path: Path, make_cluster: MakeCluster) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("checkpoints cannot go under a regular file\n")
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        address = cluster.start_coordinator(port=0)
        client = Client(address)
        cluster.add_node("ps")
        cluster.add_node("w0")
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 2, 60, "nodes")
        job = client.submit({
            "name": "ckpt-fail", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
            "mode": "async", "lr": 0.05, "num_ps_shards": 1, "ps_backup": False, "min_workers": 1,
            "max_workers": 1, "total_steps": 100_000, "checkpoint_every": 20,
            "checkpoint_dir": str(blocker / "ckpt"),
        })
        event = wait_event(job, lambda e: e["kind"] == "warning" and "checkpoint write failed" in e["message"],
                           180, "the checkpoint failure event")
        assert "parameter_server 0" in event["message"] and "NotADirectoryError" in event["message"], event
        wait_for(lambda: job.status()["metrics"].get("ckpt_failed", 0) >= 1, 60, "ckpt_failed in the status")
        env = {**os.environ, "COLUMNS": "200"}
        out = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "status", job.id, "-c", address],
                             capture_output=True, text=True, timeout=60, env=env)
        job.cancel()
    assert out.returncode == 0, out.stderr
    assert "checkpoint writes failed" in out.stdout, out.stdout
