"""CurveZMQ on the data plane, and size and rate limits on its servers: real sockets on loopback, real processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from gossamer.core.errors import ShardError, UnavailableError
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.security.curve import CurveKeyPair, CurveKeyring, HandshakeMonitor
from gossamer.training.gossip import PushSumPeer
from gossamer.transport.frames import MIN_MESSAGE_BYTES, FrameLimits, Message, decode, encode
from gossamer.transport.ratelimit import RateLimit
from tests._fixtures import InProcessCoordinator, MakeCluster, StartCoordinator

pytestmark = pytest.mark.timeout(120)

EXP = "curve-test"
NOT_MEMBER = "not, or no longer, a member"


def shard_config(**over: Any) -> ShardConfig:
    return ShardConfig(experiment=EXP, shard=0, mode="async", staleness=None,
                       optimizer=OptimizerConfig(name="sgd", lr=0.5), total_steps=10_000, **over)


class Node:
    """A node's key pair and the keyring its role process would hold."""

    def __init__(self) -> None:
        self.keys = CurveKeyPair.generate()
        self.keyring = CurveKeyring(self.keys)


@pytest.fixture
def plan() -> ShardPlan:
    return ShardPlan.build([("w", 40), ("b", 8)], 1, chunk_numel=16)


@pytest.fixture
def curve_shard(plan: ShardPlan) -> Iterator[tuple[ShardServer, str, Node, Node]]:
    """A CURVE shard whose only member is `worker`; yields (server, endpoint, server node, worker node)."""
    server_node, worker = Node(), Node()
    server_node.keyring.update(members=[worker.keys.public])
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    srv = ShardServer(shard_config(), plan, init, curve=server_node.keyring)
    endpoint = srv.bind()
    srv.start()
    worker.keyring.update(server_keys={endpoint: server_node.keys.public})
    try:
        yield srv, endpoint, server_node, worker
    finally:
        srv.close()


def client(plan: ShardPlan, endpoint: str, keyring: CurveKeyring | None, timeout_s: float = 2.0,
           sender: str = "w0") -> ShardClient:
    return ShardClient(experiment=EXP, sender=sender, plan=plan, endpoints={0: endpoint}, timeout_s=timeout_s,
                       curve=keyring)


def grads(plan: ShardPlan, value: float = 1.0) -> dict[int, torch.Tensor]:
    return {c.index: torch.full((c.numel,), value) for c in plan.chunks}


# -- parameter-server shard ---------------------------------------------------------------------


def test_a_member_pushes_and_pulls_over_curve(plan: ShardPlan, curve_shard: Any) -> None:
    srv, endpoint, _, worker = curve_shard
    with client(plan, endpoint, worker.keyring) as c:
        c.hello(fresh=True)
        res = c.push_pull(grads(plan), clock=0, basis={0: 0})
        assert res.versions == {0: 1}
        assert all(torch.equal(v, torch.full_like(v, -0.5)) for v in res.values.values())
        assert c.pull().versions == {0: 1}
    st = srv.stats()
    assert (st["updates"], st["curve_refused"], st["not_member"], st["rate_limited"]) == (1, 0, 0, 0)


def test_a_plaintext_socket_is_refused_and_the_client_says_why(plan: ShardPlan, curve_shard: Any) -> None:
    srv, endpoint, _, worker = curve_shard
    with client(plan, endpoint, None) as plain:
        with pytest.raises(UnavailableError, match="one side uses CURVE and the other plaintext"):
            plain.pull()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.connect(endpoint)
        raw.send_multipart(encode(Message(op="STATS", experiment=EXP, shard=0)))
        assert raw.poll(500) == 0  # nothing ever comes back to a plaintext socket
    finally:
        raw.close(linger=0)
        ctx.term()
    with client(plan, endpoint, worker.keyring) as member:  # the shard still serves its members
        assert member.pull().versions == {0: 0}
    assert srv.stats()["updates"] == 0


def test_a_random_key_is_refused_and_the_client_gets_a_clear_error(plan: ShardPlan, curve_shard: Any) -> None:
    srv, endpoint, server_node, _ = curve_shard
    stranger = Node()
    stranger.keyring.update(server_keys={endpoint: server_node.keys.public})  # even knowing the server key
    with client(plan, endpoint, stranger.keyring) as c:
        t0 = time.monotonic()
        with pytest.raises(UnavailableError) as err:
            c.push_pull(grads(plan), clock=0, basis={0: 0})
        assert time.monotonic() - t0 < 5.0
    message = str(err.value)
    assert "did not complete the ZMQ handshake" in message and NOT_MEMBER in message, message
    assert "HANDSHAKE_FAILED_AUTH" in message, message
    st = srv.stats()
    assert st["curve_refused"] >= 1 and st["updates"] == 0


def test_a_member_removed_from_the_allow_list_is_refused_afterwards(plan: ShardPlan, curve_shard: Any) -> None:
    srv, endpoint, server_node, worker = curve_shard
    with client(plan, endpoint, worker.keyring) as c:
        c.hello(fresh=True)
        c.push_pull(grads(plan), clock=0, basis={0: 0})
        server_node.keyring.update(members=[])  # the coordinator removed the node
        # Its open connection: every message is checked, so the next one is refused at once.
        with pytest.raises(ShardError, match="PERMISSION_DENIED"):
            c.push_pull(grads(plan), clock=1, basis={0: 1})
    # A new connection with that key fails the handshake.
    with client(plan, endpoint, worker.keyring) as again, pytest.raises(UnavailableError, match=NOT_MEMBER):
        again.pull()
    st = srv.stats()
    assert st["updates"] == 1 and st["not_member"] == 1 and st["curve_refused"] >= 1


def test_a_node_refused_before_the_shard_hears_of_its_key_gets_in_once_it_does(
    plan: ShardPlan, curve_shard: Any
) -> None:
    srv, endpoint, server_node, _ = curve_shard
    late = Node()
    late.keyring.update(server_keys={endpoint: server_node.keys.public})
    with client(plan, endpoint, late.keyring, timeout_s=10.0, sender="late") as c:
        t0 = time.monotonic()
        admit = threading.Timer(0.8, lambda: server_node.keyring.update(
            members=[*server_node.keyring.members, late.keys.public]))
        admit.start()
        try:
            assert c.pull().versions == {0: 0}
        finally:
            admit.cancel()
        assert 0.8 <= time.monotonic() - t0 < 5.0
        assert c.handshake_retries >= 1
    assert srv.stats()["curve_refused"] >= 1


def test_a_backup_is_replicated_over_curve(plan: ShardPlan) -> None:
    primary_node, backup_node, worker = Node(), Node(), Node()
    members = [primary_node.keys.public, backup_node.keys.public, worker.keys.public]
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    primary = ShardServer(shard_config(), plan, init, curve=primary_node.keyring)
    backup = ShardServer(shard_config(), plan, init, curve=backup_node.keyring, backup=True)
    try:
        for n in (primary_node, backup_node):
            n.keyring.update(members=members)
        p_ep, b_ep = primary.bind(), backup.bind()
        primary_node.keyring.update(server_keys={b_ep: backup_node.keys.public})
        worker.keyring.update(server_keys={p_ep: primary_node.keys.public})
        primary.start()
        backup.start()
        primary.post(lambda: primary.set_backup(b_ep))
        # Pushes acknowledged before the backup's SYNC lands count as unreplicated, by design:
        # the property under test starts once the backup is attached (its CURVE handshake and
        # SYNC took longer than the first pushes with two test files running beside it).
        deadline = time.monotonic() + 30
        while not primary.replicated:
            assert time.monotonic() < deadline, "the backup never synced over CURVE"
            time.sleep(0.01)
        with client(plan, p_ep, worker.keyring) as c:
            c.hello(fresh=True)
            for clock in range(3):
                c.push_pull(grads(plan), clock=clock, basis={0: clock})
        assert primary.replicated and backup.version == primary.version == 3
        assert all(torch.equal(backup.values()[i], v) for i, v in primary.values().items())
        assert primary.stats()["unreplicated"] == 0
    finally:
        primary.close()
        backup.close()


# -- size and rate limits -----------------------------------------------------------------------


def test_default_size_limit_fits_the_shard_and_an_oversized_frame_is_dropped(plan: ShardPlan) -> None:
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    srv = ShardServer(shard_config(), plan, init)
    assert srv.limits == FrameLimits.for_values(plan.shard_numel(0))
    assert srv.limits.max_message_bytes == MIN_MESSAGE_BYTES  # a tiny shard: the floor
    big = FrameLimits.for_values(10_000_000)
    assert big.max_message_bytes == 4 * 4 * 10_000_000 + FrameLimits().max_header_bytes
    endpoint = srv.bind()
    srv.start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    watch = HandshakeMonitor(raw)
    try:
        raw.connect(endpoint)
        raw.send(b"x" * (srv.limits.max_message_bytes + 1))
        assert raw.poll(500) == 0  # libzmq drops the connection: no reply is possible
        watch.check()
        assert watch.dropped >= 1
        with client(plan, endpoint, None) as c:  # and the shard still serves
            c.hello(fresh=True)
            assert c.push_pull(grads(plan), clock=0, basis={0: 0}).versions == {0: 1}
    finally:
        watch.close()
        raw.close(linger=0)
        ctx.term()
        srv.close()


def test_a_client_whose_message_is_over_the_size_limit_is_told_so(plan: ShardPlan) -> None:
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    srv = ShardServer(shard_config(limits=FrameLimits(max_message_bytes=64 << 10)), plan, init)
    endpoint = srv.bind()
    srv.start()
    try:
        with client(plan, endpoint, None) as c:
            with pytest.raises(UnavailableError, match=r"dropped the connection .*size limit \(MAXMSGSIZE\)"):
                c.probe(nbytes=256 << 10)  # a 256 KiB frame to a shard that takes 64 KiB
            assert c.pull().versions == {0: 0}  # the same client, on its new socket, is served
    finally:
        srv.close()


def test_a_flood_gets_rate_limit_errors_and_the_shard_still_serves_members(plan: ShardPlan) -> None:
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    srv = ShardServer(shard_config(rate_limit=RateLimit(messages_per_s=20, burst=10, answer_every_s=0.0)), plan,
                      init)
    endpoint = srv.bind()
    srv.start()
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    try:
        flood.connect(endpoint)
        n = 300
        for i in range(n):
            flood.send_multipart(encode(Message(op="STATS", experiment=EXP, shard=0, meta={"rid": i})))
        replies = []
        while len(replies) < n and flood.poll(1000):
            replies.append(decode(flood.recv_multipart()))
        limited = [r for r in replies if r.op == "ERROR" and r.meta["code"] == "RATE_LIMITED"]
        assert len(replies) == n  # answer_every_s=0: every refused message is answered
        assert 10 <= n - len(limited) <= 40, n - len(limited)  # the burst, and what refilled meanwhile
        assert all("rate limit" in r.meta["error"] and isinstance(r.meta["rid"], int) for r in limited)
        with client(plan, endpoint, None) as member:  # another peer has its own bucket
            member.hello(fresh=True)
            assert member.push_pull(grads(plan), clock=0, basis={0: 0}).versions == {0: 1}
        assert srv.stats()["rate_limited"] == len(limited)
    finally:
        flood.close(linger=0)
        ctx.term()
        srv.close()


def test_a_flooder_that_never_reads_gets_one_error_per_interval(plan: ShardPlan) -> None:
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks}
    srv = ShardServer(shard_config(rate_limit=RateLimit(messages_per_s=10, burst=5, answer_every_s=10.0)), plan,
                      init)
    endpoint = srv.bind()
    srv.start()
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    try:
        flood.connect(endpoint)
        for i in range(200):
            flood.send_multipart(encode(Message(op="STATS", experiment=EXP, shard=0, meta={"rid": i})))
        replies = []
        while flood.poll(500):
            replies.append(decode(flood.recv_multipart()))
        assert [r.op for r in replies].count("ERROR") == 1  # the rest dropped, not queued for it
        assert srv.stats()["rate_limited"] >= 150
    finally:
        flood.close(linger=0)
        ctx.term()
        srv.close()


# -- gossip peers -------------------------------------------------------------------------------


@pytest.fixture
def closing() -> Iterator[list[PushSumPeer]]:
    peers: list[PushSumPeer] = []
    yield peers
    for p in peers:
        p.close()


DIM = 500


def curve_peers(n: int, closing: list[PushSumPeer], **kw: Any) -> tuple[list[PushSumPeer], list[Node]]:
    nodes = [Node() for _ in range(n)]
    for node in nodes:
        node.keyring.update(members=[m.keys.public for m in nodes])
    peers = [PushSumPeer(experiment=EXP, peer_id=f"p{i}", numel=DIM, curve=nodes[i].keyring, **kw)
             for i in range(n)]
    closing.extend(peers)
    keys = {p.endpoint: node.keys.public for p, node in zip(peers, nodes, strict=True)}
    for node in nodes:
        node.keyring.update(server_keys=keys)
    for p in peers:
        p.set_membership({q.peer_id: q.endpoint for q in peers if q is not p}, 1)
    return peers, nodes


def test_gossip_members_exchange_mass_over_curve(closing: list[PushSumPeer]) -> None:
    (a, b), _ = curve_peers(2, closing, ack_timeout_s=0.5)
    za, zb = torch.zeros(DIM), torch.full((DIM,), 2.0)
    for r in range(20):
        a.mix(za)
        b.mix(zb)
        a.send(za, "p1", step=r)
        b.send(zb, "p0", step=r)
        assert a.wait_settled(5.0) and b.wait_settled(5.0)
    a.mix(za)
    b.mix(zb)
    assert a.weight + b.weight == pytest.approx(2.0, abs=1e-9)
    assert float((za - 1).abs().max()) < 1e-3 and float((zb - 1).abs().max()) < 1e-3
    assert a.handshake_failures == b.handshake_failures == a.refused_handshakes == 0
    got: list[Any] = []
    asker = threading.Thread(target=lambda: got.append(b.request_snapshot("p0", timeout=5.0)))
    asker.start()
    while asker.is_alive():
        a.serve(za, step=20)  # the trainer's idle loop answers snapshot requests
        time.sleep(0.005)
    assert got[0] is not None and got[0].step == 20 and got[0].z.numel() == DIM


def test_gossip_refuses_plaintext_and_unknown_keys_and_the_client_knows(closing: list[PushSumPeer]) -> None:
    (a, _b), nodes = curve_peers(2, closing)
    plain = PushSumPeer(experiment=EXP, peer_id="plain", numel=DIM, curve=None)
    stranger_node = Node()
    stranger_node.keyring.update(server_keys={a.endpoint: nodes[0].keys.public}, members=[stranger_node.keys.public])
    stranger = PushSumPeer(experiment=EXP, peer_id="stranger", numel=DIM, curve=stranger_node.keyring)
    closing.extend([plain, stranger])
    for p in (plain, stranger):
        t0 = time.monotonic()
        assert p.request_snapshot(a.endpoint, timeout=5.0) is None
        assert time.monotonic() - t0 < 3.0  # a refused handshake fails the request at once
        assert p.handshake_failures >= 1
    # Mass sent by the stranger never arrives, and comes back once it drops the neighbour.
    stranger.set_membership({"p0": a.endpoint}, 1)
    z = torch.ones(DIM)
    stranger.send(z, "p0", step=0)
    time.sleep(0.5)
    assert a.mix(torch.zeros(DIM)).received == 0
    stranger.set_membership({}, 2)
    stranger.mix(z)
    assert stranger.pending() == 0 and float((z - 1).abs().max()) < 1e-6
    assert a.refused_handshakes >= 2


def test_gossip_member_removed_from_the_allow_list_is_refused(closing: list[PushSumPeer]) -> None:
    (a, b), nodes = curve_peers(2, closing, ack_timeout_s=0.3)
    za, zb = torch.zeros(DIM), torch.full((DIM,), 2.0)
    b.send(zb, "p0", step=0)
    assert b.wait_settled(5.0)
    assert a.mix(za).received == 1
    nodes[0].keyring.update(members=[nodes[0].keys.public])  # b is no longer a member
    b.send(zb, "p0", step=1)
    time.sleep(0.8)  # the MASS and its CANCELs are refused: nothing of it is decided
    assert a.mix(za).received == 0
    assert a.rejected.get("not_member", 0) >= 1
    b.set_membership({}, 2)
    b.mix(zb)
    assert b.pending() == 0


def test_gossip_flood_gets_rate_limit_errors_and_gossip_goes_on(closing: list[PushSumPeer]) -> None:
    a, b = (PushSumPeer(experiment=EXP, peer_id=f"p{i}", numel=DIM, ack_timeout_s=0.5,
                        rate_limit=RateLimit(messages_per_s=20, burst=10, answer_every_s=0.0)) for i in range(2))
    closing.extend([a, b])
    for p, q in ((a, b), (b, a)):
        p.set_membership({q.peer_id: q.endpoint}, 1)
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    try:
        flood.connect(a.endpoint)
        for i in range(100):
            flood.send_multipart(encode(Message(op="FROB", experiment=EXP, sender="x", meta={"rid": i})))
        codes = []
        deadline = time.monotonic() + 60  # every request is answered; a loaded machine may take seconds
        while len(codes) < 100 and time.monotonic() < deadline:
            if flood.poll(100):
                codes.append(decode(flood.recv_multipart()).meta.get("code"))
        assert len(codes) == 100, f"{len(codes)} answered; sends that failed: {a.send_failures}"
        assert a.send_failures == 0  # no answer dropped on a full queue: this flooder reads them all
        assert codes.count("RATE_LIMITED") >= 60 and a.rejected["rate_limit"] == codes.count("RATE_LIMITED")
    finally:
        flood.close(linger=0)
        ctx.term()
    za, zb = torch.zeros(DIM), torch.full((DIM,), 2.0)
    for r in range(5):
        b.send(zb, "p0", step=r)
        assert b.wait_settled(5.0)
        a.mix(za)
    assert b.mix(zb).restored == 0  # every MASS of the neighbour was accepted


# -- the coordinator hands out the keys ---------------------------------------------------------


def _latest(stream: Any, want: Any, timeout: float = 20.0) -> Any:
    """The first assignment set from `stream` for which `want(assignments)` holds."""
    deadline = time.monotonic() + timeout
    for aset in stream:
        if want(list(aset.assignments)):
            return list(aset.assignments)
        assert time.monotonic() < deadline
    raise AssertionError("stream ended")


def test_coordinator_hands_out_member_and_server_keys_and_drops_a_leaver(
        tmp_path: Path, start_coordinator: StartCoordinator) -> None:
    import json

    import grpc

    from gossamer.v1 import coordinator_pb2 as pb
    from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

    def stub(c: InProcessCoordinator) -> Any:
        return pb_grpc.NodeServiceStub(grpc.insecure_channel(c.address))

    coord = start_coordinator(tmp_path / "s", lease_timeout_s=30.0, curve=True)
    ps_keys, wk_keys, ep = CurveKeyPair.generate(), CurveKeyPair.generate(), "tcp://127.0.0.1:5555"
    try:
        nodes = stub(coord)
        with pytest.raises(grpc.RpcError) as err:  # a node without a key cannot join a CURVE data plane
            nodes.Join(pb.JoinRequest(name="old", address="127.0.0.1"), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "curve_public_key" in err.value.details()
        with pytest.raises(grpc.RpcError, match="z85"):
            nodes.Join(pb.JoinRequest(name="bad", curve_public_key="~" * 40), timeout=5)
        ps = nodes.Join(pb.JoinRequest(name="ps", address="127.0.0.1", curve_public_key=ps_keys.public), timeout=5)
        assert ps.curve
        wk = nodes.Join(pb.JoinRequest(name="wk", address="127.0.0.1", spot=True, curve_public_key=wk_keys.public),
                        timeout=5)
        exps = pb_grpc.ExperimentServiceStub(grpc.insecure_channel(coord.address))
        exp_id = exps.Submit(pb.SubmitRequest(experiment_json=json.dumps({
            "name": "t", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
            "num_ps_shards": 1, "min_workers": 1, "ps_backup": False})), timeout=60).experiment_id
        ps_stream = nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=ps.node_id), timeout=30)
        (a,) = _latest(ps_stream, lambda x: len(x) == 1)
        assert list(a.curve_members) == sorted([ps_keys.public, wk_keys.public])
        nodes.ReportRole(pb.ReportRoleRequest(node_id=ps.node_id, experiment_id=exp_id, role=pb.ROLE_PARAMETER_SERVER,
                                              index=0, state=pb.ROLE_STATE_SERVING, endpoint=ep))
        wk_stream = nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=wk.node_id), timeout=30)
        (w,) = _latest(wk_stream, lambda x: len(x) == 1)
        assert dict(w.curve_server_keys) == {ep: ps_keys.public} and dict(w.shard_endpoints) == {0: ep}
        # Each sender id is bound to its own node's key: the worker's, and the primary's replication id.
        assert dict(w.curve_senders) == {f"{wk.node_id}:{w.index}": wk_keys.public, "shard-0": ps_keys.public}
        nodes.Leave(pb.LeaveRequest(node_id=wk.node_id, reason="test"), timeout=5)
        (a,) = _latest(ps_stream, lambda x: len(x) == 1 and list(x[0].curve_members) == [ps_keys.public])
        assert dict(a.curve_senders) == {"shard-0": ps_keys.public}
        ps_stream.cancel()
        wk_stream.cancel()
    finally:
        coord.close()
    # The keys survive a coordinator restart: the running shard re-attaches with the same one.
    again = start_coordinator(tmp_path / "s", lease_timeout_s=30.0, curve=True)
    try:
        nodes = stub(again)
        assert nodes.Join(pb.JoinRequest(node_id=ps.node_id, name="ps", curve_public_key=ps_keys.public),
                          timeout=5).curve
        stream = nodes.WatchAssignments(pb.WatchAssignmentsRequest(node_id=ps.node_id), timeout=30)
        (a,) = _latest(stream, lambda x: len(x) == 1)
        assert list(a.curve_members) == [ps_keys.public] and dict(a.curve_server_keys) == {ep: ps_keys.public}
        stream.cancel()
    finally:
        again.close()


def test_a_plaintext_coordinator_hands_out_no_keys(tmp_path: Path, start_coordinator: StartCoordinator) -> None:
    import grpc

    from gossamer.v1 import coordinator_pb2 as pb
    from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

    coord = start_coordinator(tmp_path / "s", lease_timeout_s=30.0)
    try:
        assert not coord.config.data_plane_curve
        nodes = pb_grpc.NodeServiceStub(grpc.insecure_channel(coord.address))
        resp = nodes.Join(pb.JoinRequest(name="n", curve_public_key=CurveKeyPair.generate().public), timeout=5)
        assert not resp.curve
    finally:
        coord.close()


# -- real processes -----------------------------------------------------------------------------


@pytest.mark.timeout(420)
def test_secured_cluster_runs_curve_and_refuses_strangers_end_to_end(tmp_path: Path, make_cluster: MakeCluster) -> None:
    """TLS + token via LocalCluster(secure=...): CURVE is on by default; a digits run completes,
    and while it runs a plaintext socket and a stranger's key are refused by its shard."""
    from gossamer.core.experiment import Experiment
    from gossamer.examples.digits import mlp

    spec = {
        "name": "curve-e2e", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "lr": 0.05, "momentum": 0.9, "num_ps_shards": 1, "min_workers": 2, "max_workers": 2,
        "total_steps": 600, "eval_every": 300, "staleness": 4,
    }
    with make_cluster(state_dir=tmp_path / "state", secure=tmp_path / "secure") as cluster:
        cluster.start_coordinator(port=0)
        client = cluster.client()
        for i in range(4):  # a shard, its backup and two workers
            cluster.add_node(f"n{i}")
        deadline = time.monotonic() + 90
        while sum(n["state"] == "ready" for n in client.nodes()) < 4:
            assert time.monotonic() < deadline, client.nodes()
            time.sleep(0.2)
        job = client.submit(spec)
        endpoint = ""
        while not endpoint and time.monotonic() < deadline + 120:
            st = job.status()
            endpoint = next((r["endpoint"] for r in st["roles"] if r["role"] == "ps" and not r.get("replica")
                             and st["state"] == "running"), "")
            time.sleep(0.1)
        assert endpoint, job.status()
        plan = ShardPlan.for_module(mlp(), 1, Experiment.from_dict(spec).chunk_numel)
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        watch = HandshakeMonitor(raw)
        try:
            raw.connect(endpoint)
            deadline2 = time.monotonic() + 5
            while watch.check() is None and time.monotonic() < deadline2:
                time.sleep(0.05)
            assert watch.failure is not None and "the other plaintext" in watch.failure, watch.failure
        finally:
            watch.close()
            raw.close(linger=0)
            ctx.term()
        stranger = Node()
        # The real server key is not even needed to be refused; a wrong one fails earlier still.
        stranger.keyring.update(server_keys={endpoint: CurveKeyPair.generate().public})
        with ShardClient(experiment=job.id, sender="stranger", plan=plan, endpoints={0: endpoint}, timeout_s=2.0,
                         curve=stranger.keyring) as c, pytest.raises(UnavailableError, match="handshake"):
            c.pull()
        result = job.wait(timeout=300)
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "state" / "logs").glob("n*.log"))
    assert result.status == "completed", result
    assert result.metrics["eval_accuracy"] >= 0.9, result.metrics
    assert "over CurveZMQ" in logs
    # The primary replicates under `shard-0`, bound to its own node's key: the backup took it.
    assert "backup synced at version" in logs and "backup refused replication" not in logs, logs[-3000:]


@pytest.mark.timeout(420)
def test_gossip_over_curve_through_real_processes_with_the_explicit_flag(tmp_path: Path, make_cluster: MakeCluster) -> None:
    """`--curve` on a plaintext coordinator: gossip workers find each other through the keys
    their assignments carry, train to completion, and none refuses a member.

    Steps are slowed (50 ms) so the workers overlap although their processes start seconds
    apart: a worker that comes up late copies a peer's parameters, the lead gathers every
    peer's at the end, all over CURVE."""
    spec = {
        "name": "curve-gossip", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "gossip", "lr": 0.05, "momentum": 0.9, "min_workers": 3, "max_workers": 3,
        "total_steps": 300, "eval_every": 0,
    }
    with make_cluster(state_dir=tmp_path / "state", coordinator_args=["--curve"]) as cluster:
        cluster.start_coordinator(port=0)
        client = cluster.client()
        for i in range(3):
            cluster.add_node(f"g{i}", env={"GOSSAMER_FAULT": "delay:seconds=0.05"})
        deadline = time.monotonic() + 90
        while sum(n["state"] == "ready" for n in client.nodes()) < 3:
            assert time.monotonic() < deadline, client.nodes()
            time.sleep(0.2)
        job = client.submit(spec)
        result = job.wait(timeout=300)
        history = job.metrics()
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "state" / "logs").glob("g*.log"))
    assert result.status == "completed", result
    assert result.metrics["eval_accuracy"] >= 0.9, result.metrics
    final = [p for p in history if "gossip_peers" in p]
    assert final and final[-1]["gossip_peers"] >= 2, final  # the lead got a peer's parameters over CURVE
    assert sum(p.get("bytes_down", 0) for p in history) > 0
    refused = {k: v for p in history for k, v in p.items() if k.startswith("gossip_refused_not_member") and v}
    assert not refused, refused
    assert "did not complete the ZMQ handshake" not in logs and "refused a CURVE handshake" not in logs
