"""Prometheus /metrics of the coordinator and of a node, scraped during a real run; the HTTP side's error handling."""

from __future__ import annotations

import json
import socket
import time

import pytest

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import InProcessCoordinator, StartCoordinator
from tests.integration._observability import (
    HTTP_ENV,
    digits,
    get,
    http_port,
    node_metrics_port,
    scrape,
    value,
    wait_ready,
    wait_steps,
)

pytestmark = [pytest.mark.timeout(420), pytest.mark.cluster(env=HTTP_ENV)]


def test_metrics_scraped_during_a_run_show_steps_rising_and_bytes_counted(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    base = f"http://127.0.0.1:{http_port(cluster)}"
    cluster.add_node("ps")
    for name in ("w0", "w1"):
        cluster.add_node(name, spot=True)
    client = Client(address)
    wait_ready(client, 3)
    job = client.submit(digits("metrics", workers=2))
    try:
        wait_steps(job, 100)
        deadline = time.monotonic() + 240
        while True:  # both workers stepping (one may start well after the other under load)
            st = job.status()
            if all(r["step_rate"] > 0 for r in st["roles"] if r["role"] == "worker"):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
        first = scrape(f"{base}/metrics")
        wait_steps(job, int(value(first, "gossamer_experiment_steps_total", experiment=job.id)) + 100)
        time.sleep(1.5)
        second = scrape(f"{base}/metrics")
        shard_port, worker_port = node_metrics_port(cluster, "ps"), node_metrics_port(cluster, "w0")
        ps, w0 = scrape(f"http://127.0.0.1:{shard_port}/metrics"), scrape(f"http://127.0.0.1:{worker_port}/metrics")
    finally:
        job.cancel()
        client.close()

    exp = {"experiment": job.id}
    steps = [value(m, "gossamer_experiment_steps_total", **exp) for m in (first, second)]
    assert steps[1] >= steps[0] + 100 > 100, steps
    assert value(first, "gossamer_experiment_bytes_up_total", **exp) > 0
    assert value(second, "gossamer_experiment_bytes_down_total", **exp) > value(first, "gossamer_experiment_bytes_down_total", **exp)
    assert 0 < value(second, "gossamer_experiment_loss", **exp) < 10
    assert value(second, "gossamer_experiment_compression_ratio", **exp) > 0.5
    assert value(second, "gossamer_experiment_staleness_count", **exp, shard="0") > 100
    assert value(second, "gossamer_experiment_staleness_bucket", **exp, shard="0", le="+Inf") == \
        value(second, "gossamer_experiment_staleness_count", **exp, shard="0")
    assert value(second, "gossamer_experiment_generation", **exp) >= 1
    assert value(second, "gossamer_experiment_nodes_lost_total", **exp) == 0
    assert value(second, "gossamer_experiment_recoveries_total", **exp, kind="promotion") == 0
    assert value(second, "gossamer_nodes", state="busy") == 3
    for name in ("w0", "w1"):
        node = {"experiment": job.id, "node": name}
        assert value(second, "gossamer_node_steps_total", **node) > value(first, "gossamer_node_steps_total", **node)
        assert value(second, "gossamer_node_bytes_up_total", **node) > 0
        assert value(second, "gossamer_node_step_rate", **node) > 0
        assert value(second, "gossamer_node_straggler", **node) == 0
    for name in ("ps", "w0", "w1"):
        assert 0 <= value(second, "gossamer_node_lease_age_seconds", node=name) < 5.0

    # The nodes' own /metrics: the worker's step counter and bytes, the shard's applied updates.
    assert value(w0, "gossamer_worker_steps_total", node="w0", rank="0", **exp) > 0
    assert value(w0, "gossamer_worker_bytes_up_total", node="w0", rank="0", **exp) > 0
    assert value(w0, "gossamer_agent_role_processes", node="w0", role="worker", **exp) == 1
    assert value(ps, "gossamer_shard_updates_total", node="ps", shard="0", **exp) > 100
    assert value(ps, "gossamer_shard_primary", node="ps", shard="0", **exp) == 1
    assert value(ps, "gossamer_shard_staleness_count", node="ps", shard="0", **exp) > 100
    assert value(ps, "gossamer_agent_bad_reports_total", node="ps") == 0


@pytest.fixture
def served(start_coordinator: StartCoordinator) -> InProcessCoordinator:
    """An in-process coordinator serving its HTTP side on a free port (default leases)."""
    return start_coordinator(http=True, heartbeat_interval_s=1.0, lease_timeout_s=10.0)


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_http_side_refuses_bad_requests_with_a_clear_status_and_keeps_serving(served: InProcessCoordinator) -> None:
    port = served.server.http_port
    assert _raw(port, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(port, b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert _raw(port, b"GET /" + b"a" * 40_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 431 ")
    assert _raw(port, b"GET /metrics HTTP/1.1\r\n") == b""  # cut short: closed, nothing to answer
    assert get(f"{served.base}/nope")[0] == 404
    status, _, body = get(f"{served.base}/api/series?experiment=missing")
    assert status == 404 and "does not exist" in json.loads(body)["error"]
    # ... and it still serves every route.
    assert get(f"{served.base}/healthz")[:3:2] == (200, "ok\n")
    status, ctype, body = get(f"{served.base}/api/status")
    assert status == 200 and ctype == "application/json" and json.loads(body)["experiments"] == []
    status, ctype, page = get(f"{served.base}/")
    assert status == 200 and ctype.startswith("text/html") and "<script>" in page and "http://" not in page.split(
        "<script>")[1].replace("http://www.w3.org/2000/svg", "")  # no CDN: nothing fetched from elsewhere
    assert value(scrape(f"{served.base}/metrics"), "gossamer_nodes", state="ready") == 0
