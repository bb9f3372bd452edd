"""Deadlines of an experiment on a real coordinator over gRPC: a start that does not finish, nodes that do not
return, a run that makes no progress (the nodes are this test, speaking the node protocol)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gossamer import Client
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import DIGITS, InProcessCoordinator
from tests.chaos._wait import wait_event, wait_for

pytestmark = pytest.mark.timeout(120)
PS, WORKER, SERVING = pb.ROLE_PARAMETER_SERVER, pb.ROLE_WORKER, pb.ROLE_STATE_SERVING


class Nodes:
    """Nodes joined by the test, heartbeating from a thread until they leave."""

    def __init__(self, address: str) -> None:
        self.stub = pb_grpc.NodeServiceStub(grpc.insecure_channel(address))
        self.ids: dict[str, str] = {}
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, daemon=True)
        self._beats.start()

    def join(self, *names: str) -> None:
        for name in names:  # in order: the earlier joined hosts shards first
            self.ids[name] = self.stub.Join(pb.JoinRequest(name=name, address="127.0.0.1"), timeout=5).node_id
            time.sleep(0.01)

    def leave(self, name: str) -> None:
        self.stub.Leave(pb.LeaveRequest(node_id=self.ids.pop(name), reason="test"), timeout=5)

    def report(self, exp_id: str, name: str, role: pb.Role.ValueType, index: int, **kw: Any) -> None:
        self.stub.ReportRole(pb.ReportRoleRequest(node_id=self.ids[name], experiment_id=exp_id, role=role,
                                                  index=index, state=SERVING, **kw), timeout=5)

    def _beat(self) -> None:
        while not self._stop.wait(0.1):
            for node_id in list(self.ids.values()):
                try:
                    self.stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=2)
                except grpc.RpcError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._beats.join(5)


@pytest.fixture
def nodes(coordinator: InProcessCoordinator) -> Iterator[Nodes]:
    n = Nodes(coordinator.address)
    yield n
    n.close()


def _submit(client: Client, **fields: Any) -> Any:
    return client.submit({"name": "deadlines", **DIGITS, "num_ps_shards": 1, "min_workers": 1, "max_workers": 1,
                          "ps_backup": False, **fields})


def _running(client: Client, nodes: Nodes, **fields: Any) -> Any:
    """A run on nodes "ps" and "wk" (joined here), its shard serving: the job, running."""
    nodes.join("ps", "wk")
    job = _submit(client, **fields)
    nodes.report(job.id, "ps", PS, 0, endpoint="tcp://127.0.0.1:5555")
    wait_for(lambda: job.status()["state"] == "running", 10, "running")
    return job


def _roles(job: Any) -> list[tuple[str, str, int]]:
    return sorted((r["node"], r["role"], r["replica"]) for r in job.status()["roles"])


def _node_free(client: Client, name: str) -> bool:
    return any(n["name"] == name and n["state"] == "ready" and not n["experiment"] for n in client.nodes())


def test_a_start_past_its_deadline_runs_without_the_backup_that_never_synced_and_frees_its_node(
        coordinator: InProcessCoordinator, nodes: Nodes) -> None:
    nodes.join("ps", "wk", "bk")  # workers go to the earlier joined: bk is left for the backup
    with Client(coordinator.address) as client:
        # 5 s: the primary's report below must land before the deadline, also on a loaded machine
        job = _submit(client, ps_backup=True, start_timeout_s=5)
        wait_for(lambda: ("bk", "ps", 1) in _roles(job), 10, "the backup placed")
        nodes.report(job.id, "ps", PS, 0, endpoint="tcp://127.0.0.1:5555")  # the backup never reports
        assert job.status()["state"] == "starting"
        wait_for(lambda: job.status()["state"] == "running", 20, "the start deadline")
        degraded = wait_event(job, lambda e: e["kind"] == "degraded", 5, "the degraded event")
        assert "did not sync within 5 s (start_timeout_s)" in degraded["message"], degraded
        assert _roles(job) == [("ps", "ps", 0), ("wk", "worker", 0)]
        wait_for(lambda: _node_free(client, "bk"), 5, "the backup's node freed")


def test_a_start_past_its_deadline_with_a_shard_not_serving_fails_naming_it_and_frees_every_node(
        coordinator: InProcessCoordinator, nodes: Nodes) -> None:
    nodes.join("ps", "wk")
    with Client(coordinator.address) as client:
        job = _submit(client, start_timeout_s=1)
        wait_for(lambda: job.status()["state"] == "failed", 20, "the start deadline")
        assert job.status()["message"] == "did not start within 1 s (start_timeout_s): shard 0 not serving"
        wait_for(lambda: _node_free(client, "ps") and _node_free(client, "wk"), 5, "the nodes freed")


def test_a_run_without_a_step_for_its_deadline_says_so_and_the_next_step_clears_it(
        coordinator: InProcessCoordinator, nodes: Nodes) -> None:
    exps = pb_grpc.ExperimentServiceStub(grpc.insecure_channel(coordinator.address))
    with Client(coordinator.address) as client:
        job = _running(client, nodes, progress_timeout_s=1, total_steps=100)

        def step(n: int) -> None:
            point = pb.MetricPoint(time_unix=time.time(), step=n, source="wk/0", values={"loss": 1.0})
            exps.ReportMetrics(pb.ReportMetricsRequest(experiment_id=job.id, points=[point]), timeout=5)

        step(7)
        stalled = wait_event(job, lambda e: e["kind"] == "stalled", 20, "the stalled event")
        assert "no step reported for" in stalled["message"] and "still at step 7 of 100" in stalled["message"]
        st = job.status()
        assert st["state"] == "running" and st["message"] == stalled["message"], st
        step(8)
        wait_event(job, lambda e: e["kind"] == "progress", 10, "the progress event")
        assert job.status()["message"] == ""


def test_nodes_all_gone_the_run_waits_saying_for_what_and_fails_at_its_deadline(
        coordinator: InProcessCoordinator, nodes: Nodes) -> None:
    with Client(coordinator.address) as client:
        job = _running(client, nodes, node_wait_timeout_s=8)  # the status check below must come before it, loaded or not
        nodes.leave("ps")
        nodes.leave("wk")
        waiting = wait_event(job, lambda e: e["kind"] == "waiting", 10, "the waiting event")
        want = ("waiting for a node to host shard 0 (restored from the newest checkpoint) and a node to run a "
                "worker; fails unless one comes within 8 s (node_wait_timeout_s)")
        assert waiting["message"] == want
        st = job.status()
        assert st["state"] == "running" and st["message"] == want, st
        wait_for(lambda: job.status()["state"] == "failed", 30, "the node wait deadline")
        assert job.status()["message"].startswith("no nodes came: waiting for a node to host shard 0")
        assert job.status()["message"].endswith("for 8 s (node_wait_timeout_s): giving up")


def test_a_wait_that_widens_when_a_second_loss_is_seen_says_so(
        coordinator: InProcessCoordinator, nodes: Nodes) -> None:
    with Client(coordinator.address) as client:
        job = _running(client, nodes, node_wait_timeout_s=60)
        nodes.leave("wk")
        first = wait_event(job, lambda e: e["kind"] == "waiting", 10, "the first waiting event")
        assert first["message"].startswith("waiting for a node to run a worker;"), first
        nodes.leave("ps")  # lost later: the wait now names the shard too
        both = wait_event(job, lambda e: e["kind"] == "waiting" and "host shard 0" in e["message"], 10,
                          "the widened waiting event")
        assert both["message"].startswith("waiting for a node to host shard 0 (restored from the newest checkpoint)"
                                          " and a node to run a worker;"), both
        assert job.status()["message"] == both["message"]
        assert [e["kind"] for e in job.events()].count("waiting") == 2
        nodes.join("ps2", "wk2")
        wait_event(job, lambda e: e["kind"] == "resumed", 10, "the resumed event")
        assert job.status()["message"] == ""


def test_nodes_back_before_the_deadline_restore_the_lost_shard_and_the_run_resumes(
        coordinator: InProcessCoordinator, nodes: Nodes) -> None:
    with Client(coordinator.address) as client:
        job = _running(client, nodes, node_wait_timeout_s=60)
        nodes.leave("ps")
        nodes.leave("wk")
        wait_event(job, lambda e: e["kind"] == "waiting", 10, "the waiting event")
        nodes.join("ps2", "wk2")
        wait_event(job, lambda e: e["kind"] == "resumed", 10, "the resumed event")
        assert _roles(job) == [("ps2", "ps", 0), ("wk2", "worker", 0)]
        assert job.status()["message"] == ""
        stream = nodes.stub.WatchAssignments(pb.WatchAssignmentsRequest(node_id=nodes.ids["ps2"]), timeout=10)
        (a,) = next(stream).assignments
        assert a.role == PS and a.restore_epoch > 0  # the new primary loads the newest checkpoint
        assert json.loads(a.experiment_json)["node_wait_timeout_s"] == 60
        stream.cancel()
