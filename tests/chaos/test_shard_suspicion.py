"""A shard process that lives but never answers (SIGSTOP) is suspected from its workers' timeouts and failed over."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster
from tests.chaos._wait import wait_for, wait_steps

pytestmark = pytest.mark.timeout(600)


def _role_pid(node_pid: int, comm: str) -> int | None:
    """The process named `comm` in the process group of the node agent `node_pid`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != comm:
                continue
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[2]) == node_pid:  # pgrp
            return int(entry.name)
    return None


def test_workers_timing_out_on_a_stopped_primary_get_it_suspected_and_failed_over(
    tmp_path: Path, make_cluster: MakeCluster,
) -> None:
    stopped: int | None = None
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        ps_a = cluster.add_node("ps-a")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps-a")
        cluster.add_node("ps-b")
        slow = {"GOSSAMER_FAULT": "delay:seconds=0.01"}  # spares the loaded machine's CPU
        cluster.add_node("w1", spot=True, env=slow)
        cluster.add_node("w2", spot=True, env=slow)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 90, "four nodes")
        job = client.submit({
            "name": "suspect", "model": "gossamer.examples.digits:mlp",
            "dataset": "gossamer.examples.digits:data", "mode": "async", "lr": 0.05, "momentum": 0.5,
            "num_ps_shards": 1, "min_workers": 2, "max_workers": 2, "total_steps": 1_000_000,
            "eval_every": 100_000, "chunk_numel": 512, "shard_timeout_s": 15,
        })

        def text() -> str:
            return "\n".join(f"{e['kind']}: {e['message']}" for e in job.events())

        def seen(kind: str, words: str) -> bool:
            return any(e["kind"] == kind and words in e["message"] for e in job.events())

        try:
            wait_steps(job, 300, 240, "the stop")
            wait_for(lambda: any(r["role"] == "ps" and not r["replica"] and r["replicated"]
                                 for r in job.status()["roles"]), 120, "the primary replicated")
            stopped = _role_pid(ps_a.pid, "gossamer-ps0")
            assert stopped is not None, "no primary shard process under ps-a"
            os.kill(stopped, signal.SIGSTOP)  # alive, its node heartbeating, answering nothing
            # Each worker times out after shard_timeout_s (15 s); the second timeout gets the shard suspected.
            try:
                wait_for(lambda: seen("lost", "parameter_server 0 on ps-a suspected"), 400, "the shard suspected")
            except AssertionError:
                raise AssertionError(f"the shard was not suspected:\n{text()}") from None
            # The promotion is the same handler's next event: a read between the two sees only the first.
            try:
                wait_for(lambda: seen("promote", "primary on ps-a gone"), 30, "the backup promoted")
            except AssertionError:
                raise AssertionError(f"the backup was not promoted:\n{text()}") from None
            at = job.status()["steps"]
            wait_steps(job, at + 300, 300, "progress after the failover")  # the workers reach the new primary
            events = job.events()
            nodes = {n["name"]: n for n in client.nodes()}
            status = job.status()
            job.cancel()
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
    log = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert status["state"] == "running", (status, log)
    assert nodes["ps-a"]["state"] != "lost", nodes["ps-a"]  # the node lived: only its workers saw it
    timeouts = [e for e in events if e["kind"] == "lost" and "did not answer" in e["message"]
                and e["message"].startswith("worker")]
    assert len(timeouts) == 2, log  # the two workers timed out once each; none replaced in a loop
    assert status["metrics"].get("versions_lost", 0) == 0, (status["metrics"], log)
