"""Control-plane security on a real coordinator: TLS, mutual TLS, the token, size and rate limits.

Certificates are generated per test session with `cryptography`; every coordinator binds port 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossamer import Client
from gossamer.core.errors import AuthError, UnavailableError
from gossamer.security import certs
from gossamer.security.channel import ChannelSecurity, explain_rpc_error, open_channel
from gossamer.security.tls import TLSConfig
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import InProcessCoordinator, MakeCluster, StartCoordinator
from tests._relay import TcpRelay

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)
TOKEN = "integration-token-0123456789abcdef"


@dataclass(frozen=True)
class PKI:
    """A CA with a server and a client certificate, a stranger CA's client certificate, a token."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    stranger_cert: str
    stranger_key: str
    stranger_ca: str
    token_file: str


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca = certs.issue_ca("test CA")
    srv = certs.issue_cert(ca, "coordinator", server=True, sans=["127.0.0.1", "localhost"])
    cli = certs.issue_cert(ca, "client", server=False)
    stranger_ca = certs.issue_ca("stranger CA")
    stranger = certs.issue_cert(stranger_ca, "stranger", server=False)
    return PKI(
        ca=_write(d / "ca.crt", ca.cert_pem), server_cert=_write(d / "server.crt", srv.cert_pem),
        server_key=_write(d / "server.key", srv.key_pem), client_cert=_write(d / "client.crt", cli.cert_pem),
        client_key=_write(d / "client.key", cli.key_pem), stranger_cert=_write(d / "stranger.crt", stranger.cert_pem),
        stranger_key=_write(d / "stranger.key", stranger.key_pem),
        stranger_ca=_write(d / "stranger-ca.crt", stranger_ca.cert_pem),
        token_file=_write(d / "token", (TOKEN + "\n").encode()),
    )


Start = Callable[..., InProcessCoordinator]


@pytest.fixture
def start(start_coordinator: StartCoordinator) -> Start:
    """Start an in-process coordinator with extra CoordinatorConfig fields; all are closed after the test."""
    return lambda **kw: start_coordinator(lease_timeout_s=2.0, **kw)


# --- the token --------------------------------------------------------------------------------
def test_right_token_accepted(start: Start, pki: PKI) -> None:
    c = start(token_file=pki.token_file)
    with Client(c.address, token=TOKEN) as client:
        client.ping()
        assert client.nodes() == [] and client.experiments() == []


def test_wrong_token_refused_with_clear_message(start: Start, pki: PKI) -> None:
    c = start(token_file=pki.token_file)
    with Client(c.address, token="not-the-token-0123456789") as client, \
            pytest.raises(AuthError, match=r"refused the token \(UNAUTHENTICATED: missing or wrong token\)"):
        client.nodes()


def test_missing_token_refused_with_clear_message(start: Start, pki: PKI) -> None:
    c = start(token_file=pki.token_file)
    with Client(c.address) as client:
        with pytest.raises(AuthError, match=r"refused the token \(UNAUTHENTICATED.*pass --token-file"):
            client.submit({"name": "x", "model": "gossamer.examples.digits:mlp",
                           "dataset": "gossamer.examples.digits:data"})
        # nothing was queued, and the health service still answers without a token
        client.ping()
    with Client(c.address, token=TOKEN) as client:
        assert client.experiments() == []


def test_token_also_guards_streams_and_node_calls(start: Start, pki: PKI) -> None:
    c = start(token_file=pki.token_file)
    with grpc.insecure_channel(c.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.NodeServiceStub(ch).Join(pb.JoinRequest(name="rogue"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.NodeServiceStub(ch).WatchAssignments(pb.WatchAssignmentsRequest(node_id="x"), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with Client(c.address, token=TOKEN) as client:
        assert client.nodes() == []  # the rogue never joined


# --- TLS --------------------------------------------------------------------------------------
def test_plaintext_client_against_tls_coordinator_refused_with_clear_message(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key)
    with Client(c.address) as client:
        for call in (client.ping, client.nodes):
            with pytest.raises(AuthError, match=r"speaks TLS and this client connected in plaintext: pass --tls-ca"):
                call()


def test_tls_client_with_the_right_ca_works(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key, token_file=pki.token_file)
    with Client(c.address, tls=pki.ca, token=TOKEN) as client:
        client.ping()
        assert client.nodes() == []
    # localhost is in the certificate too; an unlisted name can be overridden
    with Client(f"localhost:{c.port}", tls=pki.ca, token=TOKEN) as client:
        assert client.nodes() == []


def test_tls_client_with_a_stranger_ca_refused_with_clear_message(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key)
    with Client(c.address, tls=pki.stranger_ca) as client, \
            pytest.raises(AuthError, match="is not signed by the CA in --tls-ca"):
        client.nodes()


def test_tls_server_name_is_checked_and_can_be_overridden(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key)
    with Client(c.address, tls=TLSConfig(ca=pki.ca, server_name="other.example")) as client, \
            pytest.raises(AuthError, match="does not list that host name: pass --tls-server-name"):
        client.nodes()
    with Client(c.address, tls=TLSConfig(ca=pki.ca, server_name="localhost")) as client:
        assert client.nodes() == []


def test_tls_client_against_plaintext_coordinator_refused_with_clear_message(start: Start, pki: PKI) -> None:
    c = start()
    with Client(c.address, tls=pki.ca) as client, pytest.raises(AuthError, match=r"does not speak TLS \(plaintext\)"):
        client.nodes()


# --- mutual TLS -------------------------------------------------------------------------------
def test_mtls_without_client_certificate_refused_with_clear_message(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca)
    with Client(c.address, tls=pki.ca) as client:
        for call in (client.ping, client.nodes):
            with pytest.raises(AuthError, match=r"requires a client certificate \(mutual TLS\): pass --tls-cert"):
                call()


def test_mtls_with_client_certificate_works(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca, token_file=pki.token_file)
    tls = TLSConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    with Client(c.address, tls=tls, token=TOKEN) as client:
        client.ping()
        assert client.nodes() == []
    with Client(c.address, tls=tls) as client, pytest.raises(AuthError, match="refused the token"):
        client.nodes()  # mTLS does not replace the token when both are configured


def test_mtls_with_a_stranger_certificate_refused(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca)
    tls = TLSConfig(ca=pki.ca, cert=pki.stranger_cert, key=pki.stranger_key)
    with Client(c.address, tls=tls) as client, pytest.raises(AuthError, match="refused the client certificate"):
        client.nodes()


def test_mtls_connections_dropped_mid_handshake_are_called_again_not_blamed_on_the_certificate(
        start: Start, pki: PKI) -> None:
    # A loaded coordinator host can drop or stall a handshake; the certificate it accepts is not the cause.
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca, token_file=pki.token_file)
    tls = TLSConfig(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    relay = TcpRelay("127.0.0.1", c.port, drop_first=1)
    try:
        dropped = grpc.secure_channel(relay.address, tls.channel_credentials())
        with pytest.raises(grpc.RpcError) as lost:
            pb_grpc.NodeServiceStub(dropped).ListNodes(pb.ListNodesRequest(), timeout=10)
        dropped.close()
        assert relay.dropped == 1 and lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value
        explained = explain_rpc_error(lost.value, relay.address, ChannelSecurity(tls=tls, token=TOKEN))
        assert isinstance(explained, UnavailableError), explained
    finally:
        relay.close()
    relay = TcpRelay("127.0.0.1", c.port, drop_first=2)
    try:
        with Client(relay.address, tls=tls, token=TOKEN) as client:
            assert client.nodes() == []  # called again past the dropped connections, within the timeout
        assert relay.dropped == 2
    finally:
        relay.close()
    stranger = TLSConfig(ca=pki.ca, cert=pki.stranger_cert, key=pki.stranger_key)
    with Client(c.address, tls=stranger, token=TOKEN) as client, pytest.raises(AuthError, match="refused the client"):
        client.nodes()  # a certificate it refuses is still named at once


def test_plaintext_client_against_mtls_coordinator_refused(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca)
    with Client(c.address, token=TOKEN) as client, pytest.raises(AuthError, match="speaks TLS"):
        client.nodes()


# --- limits -----------------------------------------------------------------------------------
def test_oversized_submit_refused_and_server_still_serves(start: Start) -> None:
    c = start(max_message_bytes=64 << 10, check_imports=False)
    with grpc.insecure_channel(c.address) as ch:
        stub = pb_grpc.ExperimentServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Submit(pb.SubmitRequest(experiment_json="x" * (100 << 10)), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            stub.Submit(pb.SubmitRequest(experiment_json="{not json"), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # a small request goes through
    with Client(c.address) as client:
        job = client.submit({"name": "after", "model": "gossamer.examples.digits:mlp",
                             "dataset": "gossamer.examples.digits:data", "min_workers": 1})
        assert job.status()["state"] == "queued"


def test_rate_limit_refuses_a_burst_then_allows_again(start: Start) -> None:
    c = start(rate_limit=5.0, rate_burst=10)
    with grpc.insecure_channel(c.address) as ch:
        stub = pb_grpc.NodeServiceStub(ch)
        codes = []
        for _ in range(30):
            try:
                stub.ListNodes(pb.ListNodesRequest(), timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                details = e.details() or ""
        # the burst, plus what refilled while the calls ran (5/s), then refusals
        assert 10 <= codes.count(grpc.StatusCode.OK) <= 16, codes
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "rate limit: more than 5 requests/s (burst 10) from 127.0.0.1" in details
        time.sleep(0.5)  # 2.5 tokens back
        stub.ListNodes(pb.ListNodesRequest(), timeout=5)
        stub.ListNodes(pb.ListNodesRequest(), timeout=5)


# --- through real processes -------------------------------------------------------------------
def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_cluster_trains_digits_end_to_end(tmp_path: Path, make_cluster: MakeCluster) -> None:
    """`coordinator serve --secure DIR` (mTLS + token, created on the spot), nodes join with
    `--secure DIR/client`, the CLI submits with the same flag, roles report through it."""
    secure = tmp_path / "secure"
    # --no-import-check: on a loaded machine the submit-time import check alone can outlast the RPC deadline
    with make_cluster(state_dir=tmp_path / "cluster", secure=secure,
                      coordinator_args=["--no-import-check"]) as cluster:
        address = cluster.start_coordinator(port=0)
        assert (secure / "client" / "client.crt").is_file()
        for i in range(2):
            cluster.add_node(f"n{i}")
        client_flags = ["--coordinator", address, *cluster.client_args]
        # a client without the credentials is turned away, saying why
        out = _cli("nodes", "--coordinator", address)
        assert out.returncode == 2 and "speaks TLS" in out.stderr and "--tls-ca" in out.stderr, out.stderr
        # a worker with the certificates but no token does not join, and says why
        rogue = _cli("worker", "join", address, "--name", "rogue", "--tls-ca", str(secure / "ca.crt"),
                     "--tls-cert", str(secure / "client" / "client.crt"),
                     "--tls-key", str(secure / "client" / "client.key"))
        assert rogue.returncode == 2 and "refused the token (UNAUTHENTICATED" in rogue.stderr, rogue.stderr
        client = cluster.client()
        deadline = time.monotonic() + 60
        while sum(n["state"] == "ready" for n in client.nodes()) < 2:
            assert time.monotonic() < deadline, client.nodes()
            time.sleep(0.2)
        out = _cli("submit", str(ROOT / "examples" / "digits.toml"), *client_flags, "--wait", "--quiet",
                   "--set", "total_steps=200", "--set", "num_ps_shards=1", "--set", "min_workers=1",
                   "--set", "ps_backup=false", "--set", "eval_every=50", "--set", "checkpoint_every=0",
                   timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        exp_id = out.stdout.splitlines()[0].strip()
        result = client.job(exp_id).wait(timeout=30)
        assert result.status == "completed" and result.metrics["steps"] == 200
        assert result.metrics["eval_accuracy"] > 0.5  # reported by the roles over mTLS with the token
        assert sorted(n["name"] for n in client.nodes()) == ["n0", "n1"]  # the rogue never joined
        status = _cli("status", exp_id, *client_flags)
        assert status.returncode == 0 and "completed" in status.stdout, status.stderr
        client.close()


def test_secure_flags_from_the_environment(start: Start, pki: PKI) -> None:
    c = start(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca, token_file=pki.token_file)
    env = {"GOSSAMER_TLS_CA": pki.ca, "GOSSAMER_TLS_CERT": pki.client_cert, "GOSSAMER_TLS_KEY": pki.client_key,
           "GOSSAMER_TOKEN_FILE": pki.token_file, "GOSSAMER_COORDINATOR": c.address}

    out = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "nodes", "--json"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env={**os.environ, **env})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    sec = ChannelSecurity.from_flags(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key,
                                     token_file=pki.token_file)
    with open_channel(c.address, sec) as ch:
        assert list(pb_grpc.NodeServiceStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5).nodes) == []
