"""The only shard host killed -9 in an async run without backup or checkpoint: the shard is rebuilt from the workers' copies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gossamer import Client
from tests._fixtures import DIGITS, MakeCluster
from tests.chaos._wait import assert_running, wait_for, wait_steps

pytestmark = pytest.mark.timeout(300)

#: Steps of the runs: on the code before the reply budget let a current worker's request wait for its
#: replies' release, 3000 steps with 3 workers saw 1-35 updates refused for `reply_budget` (4 runs of 4).
STEPS = 3000


@dataclass
class Run:
    result: Any
    events: list[dict[str, Any]]
    points: list[dict[str, Any]]
    killed_at: int

    @property
    def text(self) -> str:
        return "\n".join(f"{e['kind']}: {e['message']}" for e in self.events)


def _kill_the_only_shard_host(make_cluster: MakeCluster, state: Path) -> Run:
    """Async digits, 3 spot workers, momentum 0.5, one shard, no backup, no checkpoint; its host killed -9 at 30%."""
    with make_cluster(state_dir=state) as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        for name in ("w0", "w1", "w2"):
            cluster.add_node(name, spot=True)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 60, "nodes")
        job = client.submit({**DIGITS, "name": "rebuild", "mode": "async", "lr": 0.05, "momentum": 0.5,
                             "num_ps_shards": 1, "ps_backup": False, "min_workers": 3, "max_workers": 3,
                             "total_steps": STEPS, "eval_every": 0})
        wait_steps(job, STEPS * 3 // 10, 180, "30% of the steps")
        cluster.kill_node("ps")
        killed_at = assert_running(job, "the kill of ps")["steps"]
        result = job.wait(timeout=240)
        return Run(result, job.events(), job.metrics(), killed_at)


def test_honest_workers_lose_no_update_to_the_reply_budget_before_or_after_the_shard_is_rebuilt(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    run = _kill_the_only_shard_host(make_cluster, tmp_path / "state")
    assert run.result.status == "completed", (run.result, run.text)
    assert any(e["kind"] == "restored" and "'s copy" in e["message"] for e in run.events), run.text
    # Every worker reads each reply before it asks again: none is a peer that never reads.
    assert run.result.metrics.get("discarded_reply_budget", 0.0) == 0.0, (run.result.metrics, run.text)
    assert not [e for e in run.events if e["kind"] == "discard" and "reply_budget" in e["message"]], run.text
