"""`gossamer logs ID`: the user's traceback from a role that failed on a node, read through that node's agent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gossamer import Client
from gossamer.core.errors import NotFoundError
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import experiment
from tests.chaos._wait import wait_for
from tests.integration._failing_model import MARKER

pytestmark = pytest.mark.timeout(300)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _traceback(job: object) -> str:
    try:
        return str(job.logs("worker/0")["traceback"])  # type: ignore[attr-defined]
    except NotFoundError:
        return ""


def test_logs_shows_the_users_traceback_from_the_node_that_ran_the_role(cluster: LocalCluster, tmp_path: Path) -> None:
    address = cluster.start_coordinator(port=0)
    fail = {"GOSSAMER_TEST_FAIL": "1"}  # only a worker calls the model's forward: the worker's node raises
    cluster.add_node("a", env=fail)
    cluster.add_node("b", env=fail)
    cluster.wait_joined("a", "b")
    with Client(address) as client:
        job = client.submit(experiment(model="tests.integration._failing_model:model", model_args={"after": 20},
                                       num_ps_shards=1, ps_backup=False, min_workers=1, max_workers=1,
                                       total_steps=100_000))
        wait_for(lambda: MARKER in _traceback(job), 180, "the worker's traceback on its node")
        worker_nodes = {e["node_id"] for e in job.events()} | {r["node_id"] for r in job.status()["roles"]
                                                              if r["role"] == "worker"}
        # Named, or by default the role whose traceback is newest: a worker.
        for args in (("--role", "worker/0"), ()):
            res = _cli("logs", job.id, *args, "-c", address)
            assert res.returncode == 0, res.stdout + res.stderr
            assert MARKER in res.stdout and "_failing_model.py" in res.stdout and "_check_batch" in res.stdout, res.stdout
            assert "Traceback (most recent call last)" in res.stdout
            # Each restart of the failed worker is a new worker index: by default, the newest that failed.
            assert "== worker/" in res.stderr and "last traceback of worker/" in res.stderr, res.stderr
        log = job.logs("worker/0")
        assert log["node_id"] in worker_nodes and log["role"] == "worker" and log["end"] - log["start"] <= 64 << 10
        assert "failed" in log["text"]  # the role's own log lines, not only the traceback
        # A shard's log is there too, from its own node; a role that never ran has none.
        assert job.logs("ps/0")["role"] == "ps"
        missing = _cli("logs", job.id, "--role", "worker/9999", "-c", address)
        assert missing.returncode == 1 and "no live node holds a log of worker/9999" in missing.stderr, missing.stderr
        bad = _cli("logs", job.id, "--role", "trainer/1", "-c", address)
        assert bad.returncode != 0 and "worker/N or ps/N" in bad.stderr, bad.stderr
        job.cancel()


def test_a_flood_of_log_reads_is_bounded_and_the_coordinator_keeps_serving(cluster: LocalCluster) -> None:
    """Reads past the coordinator's bound are refused at once (UNAVAILABLE, saying why) while a slow node holds
    the others, and the coordinator answers everything else meanwhile."""
    import threading

    from gossamer.coordinator.role_logs import MAX_READS
    from gossamer.core.errors import UnavailableError

    address = cluster.start_coordinator(port=0)
    slow = {"GOSSAMER_FAULT": "hold:at=logs:seconds=2"}  # the agents answer a log read slowly
    cluster.add_node("a", env=slow)
    cluster.add_node("b", env=slow)
    cluster.wait_joined("a", "b")
    with Client(address) as client:
        job = client.submit(experiment(num_ps_shards=1, ps_backup=False, min_workers=1, max_workers=1,
                                       total_steps=1_000_000))
        wait_for(lambda: job.status()["state"] == "running", 120, "the run to start")
        readers = 3 * MAX_READS
        start = threading.Barrier(readers + 1)
        answers: list[str] = []

        def read() -> None:
            start.wait()
            try:
                job.logs("ps/0")
                answers.append("log")
            except UnavailableError as e:
                answers.append(f"refused: {e}")
            except NotFoundError as e:  # the slow node timed out on a read let through: still an answer
                answers.append(f"not found: {e}")

        threads = [threading.Thread(target=read, daemon=True) for _ in range(readers)]
        for t in threads:
            t.start()
        start.wait()
        served_meanwhile = len(client.nodes())  # while the first reads wait on the slow node
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a log read hung"
        refused = [a for a in answers if a.startswith("refused")]
        assert len(answers) == readers and refused, answers
        assert all("role-log reads are in progress" in a for a in refused), refused
        assert len(refused) <= readers - 1 and served_meanwhile == 2
        job.cancel()
