"""A shard whose serve thread dies fails its process (never alive and heartbeating without serving), and the coordinator fails it over."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster
from tests.chaos._wait import wait_for

pytestmark = pytest.mark.timeout(420)


def test_a_primary_whose_serve_thread_dies_fails_its_process_and_the_backup_takes_over(
    tmp_path: Path, make_cluster: MakeCluster,
) -> None:
    once = tmp_path / "serve-loop-failed"
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        # The primary's serve thread raises outside any request (fault point serve-loop) at version 300,
        # then stays 1 s with its link to the backup closed (serve-exit): its role must not report
        # that as a detached backup, or the coordinator restores the shard instead of promoting.
        cluster.add_node("ps-a", env={"GOSSAMER_FAULT": f"fail:at=serve-loop:step=300:shard=0:once={once},"
                                                        "hold:at=serve-exit:seconds=1:shard=0"})
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps-a")
        cluster.add_node("ps-b")
        slow = {"GOSSAMER_FAULT": "delay:seconds=0.01"}  # the run outlasts the failover and the new backup's sync
        cluster.add_node("w1", spot=True, env=slow)
        cluster.add_node("w2", spot=True, env=slow)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 90, "four nodes")
        job = client.submit({
            "name": "serve-death", "model": "gossamer.examples.digits:mlp",
            "dataset": "gossamer.examples.digits:data", "mode": "async", "lr": 0.05, "momentum": 0.5,
            "num_ps_shards": 1, "min_workers": 2, "max_workers": 2, "total_steps": 3000,
            "eval_every": 500, "chunk_numel": 512,
        })

        def new_primary_replicated() -> bool:
            st = job.status()
            assert st["state"] in ("queued", "starting", "running"), "\n".join(
                [st["message"], *(f"{e['kind']}: {e['message']}" for e in job.events())])
            return any(r["role"] == "ps" and not r["replica"] and r["node"] != "ps-a" and r["replicated"]
                       for r in st["roles"])

        wait_for(new_primary_replicated, 240, "the promoted primary replicated to a new backup")
        shown = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "status", job.id, "-c", client.address],
                               capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
        result = job.wait(timeout=360)
        events = job.events()
        nodes = {n["name"]: n for n in client.nodes()}
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert once.exists(), text  # the fault fired
    assert result.status == "completed", (result, text)
    # The role process reported FAILED with the thread's death and exited; its node lives on.
    assert any(e["kind"] == "lost" and "parameter_server 0 on ps-a failed" in e["message"]
               and "serve thread of shard 0 died" in e["message"] for e in events), text
    assert nodes["ps-a"]["state"] != "lost", nodes["ps-a"]
    # Reported once, by the process itself: the agent's own report of its exit would have been
    # taken for a failure of the new backup placed on ps-a, which then never started.
    assert sum("parameter_server 0 on ps-a failed" in e["message"] for e in events) == 1, text
    assert any(e["kind"] == "promote" and "primary on ps-a gone" in e["message"] for e in events), text
    assert result.metrics.get("versions_lost", 0) == 0, (result.metrics, text)
    # `gossamer status` says whether each shard is replicated.
    assert "ps (replicated)" in shown.stdout, shown.stdout + shown.stderr
