"""The only shard host killed -9 in an async run without backup or checkpoint: the shard is rebuilt from the workers' copies."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gossamer import Client
from tests._fixtures import DIGITS, MakeCluster
from tests.chaos._wait import assert_running, wait_for, wait_steps

pytestmark = pytest.mark.timeout(300)

#: Steps of the runs: enough that a reply budget taking a worker's lagging reply releases for unread replies
#: refuses some of its updates in every run (1-35 per run measured, 4 runs of 4).
STEPS = 3000


@dataclass
class Run:
    result: Any
    events: list[dict[str, Any]]
    points: list[dict[str, Any]]
    killed_at: int
    killed_source: str  # the metric source of the shard on the killed host

    def restored(self) -> tuple[str, int, int]:
        """The `restored` event: (its text, the version rebuilt at, the versions lost it says)."""
        text = next(e["message"] for e in self.events if e["kind"] == "restored")
        found = re.search(r" at version (\d+); (?:at least )?(\d+) version\(s\) lost", text)
        assert found is not None, text
        return text, int(found.group(1)), int(found.group(2))

    @property
    def text(self) -> str:
        return "\n".join(f"{e['kind']}: {e['message']}" for e in self.events)


def _kill_the_only_shard_host(make_cluster: MakeCluster, state: Path, at: float = 0.3) -> Run:
    """Async digits, 3 spot workers, momentum 0.5, one shard, no backup, no checkpoint; its host killed -9 once
    the run has made `at` of its steps.

    Each worker waits before its first push past `at` x STEPS until the kill is done (a gate file), so the
    kill lands mid-run however fast the run goes on a quiet machine.
    """
    gate = state.parent / "killed"
    gated = {"GOSSAMER_FAULT": f"gate:at=push:step={int(STEPS * at)}:until={gate}"}
    with make_cluster(state_dir=state) as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        for name in ("w0", "w1", "w2"):
            cluster.add_node(name, spot=True, env=gated)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 60, "nodes")
        job = client.submit({**DIGITS, "name": "rebuild", "mode": "async", "lr": 0.05, "momentum": 0.5,
                             "num_ps_shards": 1, "ps_backup": False, "min_workers": 3, "max_workers": 3,
                             "total_steps": STEPS, "eval_every": 0})
        host = next(n["id"] for n in client.nodes() if n["name"] == "ps")
        # The workers stop at the gate, a few steps short of `at` when one is behind the others.
        wait_steps(job, int(STEPS * at * 0.9), 180, f"{at:.0%} of the steps")
        cluster.kill_node("ps")
        killed_at = assert_running(job, "the kill of ps")["steps"]
        gate.touch()
        result = job.wait(timeout=240)
        return Run(result, job.events(), job.metrics(), killed_at, f"{host}/ps0")


@pytest.mark.parametrize("at", [0.2, 0.35, 0.5])
def test_a_shard_rebuilt_from_the_workers_copies_never_goes_below_the_copy_and_counts_the_versions_lost_exactly(
        tmp_path: Path, make_cluster: MakeCluster, at: float) -> None:
    run = _kill_the_only_shard_host(make_cluster, tmp_path / "state", at)
    assert run.result.status == "completed", (run.result, run.text)
    text, version, lost = run.restored()
    assert "restored from worker " in text and "'s copy" in text, text
    assert version >= run.killed_at, (text, run.killed_at)  # the freshest copy: at least what was reported
    # While it waited for the copies its values were the initial ones (version 0): it reported no point then, and
    # nothing made after the rebuild (its points, the workers' progress: the versions served) is below the copy.
    shard = [p for p in run.points if p["source"].endswith("/ps0") and p["source"] != run.killed_source]
    assert all(p["step"] >= version for p in shard), ([(p["source"], p["step"]) for p in shard], text)
    since = next(e["time_unix"] for e in run.events if e["kind"] == "restored")
    after = [p for p in run.points if p["time_unix"] > since and p["source"] not in ("coordinator", run.killed_source)]
    assert after and all(p["step"] >= version for p in after), ([(p["source"], p["step"]) for p in after], text)
    # Every worker sent its copy, with its clocks: the count is exact, and the run's figure is that count.
    assert "counted exactly from every worker's copy" in text, text
    assert run.result.metrics["versions_lost"] == lost, (run.result.metrics, text)
    # No worker was served a version below the one it held: every update acknowledged is in the copy taken.
    assert lost == 0 and run.result.metrics.get("versions_regressed", 0.0) == 0.0, (run.result.metrics, text)


def test_honest_workers_lose_no_update_to_the_reply_budget_before_or_after_the_shard_is_rebuilt(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    run = _kill_the_only_shard_host(make_cluster, tmp_path / "state")
    assert run.result.status == "completed", (run.result, run.text)
    assert any(e["kind"] == "restored" and "'s copy" in e["message"] for e in run.events), run.text
    # Every worker reads each reply before it asks again: none is a peer that never reads.
    assert run.result.metrics.get("discarded_reply_budget", 0.0) == 0.0, (run.result.metrics, run.text)
    assert not [e for e in run.events if e["kind"] == "discard" and "reply_budget" in e["message"]], run.text
