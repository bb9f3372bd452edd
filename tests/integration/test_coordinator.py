"""The coordinator over real gRPC: validation, membership and leases, assignments, persistence, health."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossamer import Client, ConfigError, Experiment, UnavailableError
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import MakeCluster, StartCoordinator

pytestmark = pytest.mark.timeout(120)
BASE = {"name": "t", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"}


def _stubs(address: str) -> tuple[pb_grpc.NodeServiceStub, pb_grpc.ExperimentServiceStub]:
    ch = grpc.insecure_channel(address)
    return pb_grpc.NodeServiceStub(ch), pb_grpc.ExperimentServiceStub(ch)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"mode": "turbo"}, "mode"),
        ({"lr": -0.5}, "lr"),
        ({"model": "gossamer.examples.no_such_module:mlp"}, "model"),
        ({"dataset": "gossamer.examples.digits:no_such_fn"}, "dataset"),
        ({"learning_rate": 0.1}, "learning_rate"),
    ],
)
def test_invalid_experiment_refused_with_invalid_argument_naming_field(coordinator, patch, field) -> None:  # type: ignore[no-untyped-def]
    _, exps = _stubs(coordinator.address)
    with pytest.raises(grpc.RpcError) as err:
        exps.Submit(pb.SubmitRequest(experiment_json=json.dumps({**BASE, **patch})), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert exps.List(pb.ListExperimentsRequest()).experiments == []  # nothing was queued


def test_garbage_json_is_invalid_argument(coordinator) -> None:  # type: ignore[no-untyped-def]
    _, exps = _stubs(coordinator.address)
    with pytest.raises(grpc.RpcError) as err:
        exps.Submit(pb.SubmitRequest(experiment_json="{not json"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_maps_refusal_to_config_error(coordinator) -> None:  # type: ignore[no-untyped-def]
    with Client(coordinator.address) as client, pytest.raises(ConfigError) as err:
        client.submit(Experiment(**{**BASE, "model": "gossamer.examples.digits:nothing"}))
    assert err.value.field == "model"


def test_unreachable_coordinator_is_a_clear_error() -> None:
    with pytest.raises(UnavailableError, match="unreachable"):
        Client("127.0.0.1:1", timeout=2).ping(timeout=1)
    out = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "status", "-c", "127.0.0.1:1",
                          "--connect-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3  # unreachable: the same command may work later
    assert out.stderr.strip().splitlines() == ["gossamer: error: coordinator at 127.0.0.1:1 is unreachable"]


def test_health_service_reports_serving(coordinator) -> None:  # type: ignore[no-untyped-def]
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(coordinator.address))
    for service in ("", "gossamer.v1.NodeService", "gossamer.v1.ExperimentService"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_lease_expiry_marks_node_lost_and_leave_marks_left(coordinator) -> None:  # type: ignore[no-untyped-def]
    nodes, _ = _stubs(coordinator.address)
    a = nodes.Join(pb.JoinRequest(name="a", address="127.0.0.1"), timeout=5).node_id
    b = nodes.Join(pb.JoinRequest(name="b", address="127.0.0.1"), timeout=5).node_id
    nodes.Leave(pb.LeaveRequest(node_id=b, reason="test"), timeout=5)
    deadline = time.monotonic() + 10
    states: dict[str, int] = {}
    while time.monotonic() < deadline:
        states = {n.id: n.state for n in nodes.ListNodes(pb.ListNodesRequest()).nodes}
        if states[a] == pb.NODE_STATE_LOST:
            break
        time.sleep(0.1)
    assert states == {a: pb.NODE_STATE_LOST, b: pb.NODE_STATE_LEFT}
    assert not nodes.Heartbeat(pb.HeartbeatRequest(node_id=a), timeout=5).known  # must re-join
    events = coordinator.call(coordinator.server.coord.store.events())
    assert [e["kind"] for e in events] == ["join", "join", "leave", "lost"]


def _keepalive(nodes: pb_grpc.NodeServiceStub, ids: list[str]) -> threading.Event:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            for i in ids:
                nodes.Heartbeat(pb.HeartbeatRequest(node_id=i), timeout=5)

    threading.Thread(target=beat, daemon=True).start()
    return stop


def test_assignments_stream_servers_first_then_workers_with_endpoints(coordinator) -> None:  # type: ignore[no-untyped-def]
    nodes, exps = _stubs(coordinator.address)
    ps = nodes.Join(pb.JoinRequest(name="ps", address="127.0.0.1"), timeout=5).node_id
    time.sleep(0.01)
    wk = nodes.Join(pb.JoinRequest(name="wk", address="127.0.0.1", spot=True), timeout=5).node_id
    stop = _keepalive(nodes, [ps, wk])
    exp_json = json.dumps({**BASE, "num_ps_shards": 1, "min_workers": 1, "ps_backup": False})
    exp_id = exps.Submit(pb.SubmitRequest(experiment_json=exp_json), timeout=60).experiment_id
    ps_stream = nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=ps), timeout=20)
    wk_stream = nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=wk), timeout=20)
    first = next(ps_stream)
    assert [(a.role, a.index) for a in first.assignments] == [(pb.ROLE_PARAMETER_SERVER, 0)]
    assert list(next(wk_stream).assignments) == []  # no worker before the shard serves
    nodes.ReportRole(pb.ReportRoleRequest(node_id=ps, experiment_id=exp_id, role=pb.ROLE_PARAMETER_SERVER,
                                          index=0, state=pb.ROLE_STATE_SERVING, endpoint="tcp://127.0.0.1:5555"))
    for aset in wk_stream:
        if aset.assignments:
            (a,) = aset.assignments
            assert a.role == pb.ROLE_WORKER and a.lead and dict(a.shard_endpoints) == {0: "tcp://127.0.0.1:5555"}
            break
    st = exps.Get(pb.GetExperimentRequest(experiment_id=exp_id))
    assert st.state == pb.EXPERIMENT_STATE_RUNNING
    assert exps.Cancel(pb.CancelExperimentRequest(experiment_id=exp_id)).state == pb.EXPERIMENT_STATE_CANCELLED
    listed = {n.id: n for n in nodes.ListNodes(pb.ListNodesRequest()).nodes}
    assert all(listed[n].experiment_id == "" and listed[n].state == pb.NODE_STATE_READY for n in (ps, wk))
    stop.set()


def test_state_survives_a_restart(tmp_path: Path, start_coordinator: StartCoordinator) -> None:
    first = start_coordinator(tmp_path / "s", lease_timeout_s=5.0)
    nodes, exps = _stubs(first.address)
    # Submit first: its import check can outlast the 5 s lease on a loaded machine, and a
    # node already lost before the restart is (rightly) not re-attached.
    exp_id = exps.Submit(pb.SubmitRequest(experiment_json=json.dumps({**BASE, "min_workers": 2})),
                         timeout=150).experiment_id
    node_id = nodes.Join(pb.JoinRequest(name="keep", address="127.0.0.1"), timeout=5).node_id
    exps.ReportMetrics(pb.ReportMetricsRequest(experiment_id=exp_id, points=[
        pb.MetricPoint(time_unix=time.time(), step=3, source="x/0", values={"samples": 96.0})]))
    first.close()
    second = start_coordinator(tmp_path / "s", lease_timeout_s=5.0)
    try:
        nodes, exps = _stubs(second.address)
        assert nodes.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=5).known  # re-attaches
        st = exps.Get(pb.GetExperimentRequest(experiment_id=exp_id), timeout=5)
        assert st.state == pb.EXPERIMENT_STATE_QUEUED and st.steps == 3
        assert json.loads(st.metrics_json)["samples"] == 96.0
        pts = exps.GetMetrics(pb.GetMetricsRequest(experiment_id=exp_id), timeout=5).points
        assert [(p.step, dict(p.values)) for p in pts] == [(3, {"samples": 96.0})]
    finally:
        second.close()


def test_unknown_experiment_is_not_found(coordinator) -> None:  # type: ignore[no-untyped-def]
    _, exps = _stubs(coordinator.address)
    with pytest.raises(grpc.RpcError) as err:
        exps.Get(pb.GetExperimentRequest(experiment_id="nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_token_file_is_enforced_rather_than_silently_ignored(tmp_path: Path, make_cluster: MakeCluster) -> None:
    """--token-file was refused until tokens were checked; now it is enforced (tests/integration/test_security_grpc.py)."""
    from gossamer.core.errors import AuthError

    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("secret-token-0123456789\n")
    wrong.write_text("wrong-token-0123456789\n")
    with make_cluster(state_dir=tmp_path / "c", coordinator_args=["--token-file", str(token)]) as cluster:
        address = cluster.start_coordinator(port=0)
        with pytest.raises(AuthError, match="refused the token"):
            Client(address).nodes()
        out = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "worker", "join", address, "--token-file", str(wrong)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "refused the token" in out.stderr and "--token-file" in out.stderr
        assert Client(address, token="secret-token-0123456789").nodes() == []
