"""A deliberately slow worker is flagged as a straggler in `gossamer status`, its JSON, /metrics and the page's API."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests.integration._observability import (
    HTTP_ENV,
    SLOW,
    digits,
    get,
    http_port,
    scrape,
    value,
    wait_ready,
)

pytestmark = [pytest.mark.timeout(420), pytest.mark.cluster(env=HTTP_ENV)]


def _gossamer(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_worker_slower_than_half_the_median_is_flagged_everywhere(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    base = f"http://127.0.0.1:{http_port(cluster)}"
    cluster.add_node("ps")
    for name in ("fast0", "fast1"):
        cluster.add_node(name, spot=True)
    cluster.add_node("slow", spot=True, env=SLOW)
    client = Client(address)
    wait_ready(client, 4)
    # Fully asynchronous: with an SSP bound the fast workers would wait for the slow one and
    # every rate would be the slow one's (the shards' wait counters show that case).
    job = client.submit(digits("stragglers", workers=3, staleness=None, eval_every=0))
    try:
        deadline = time.monotonic() + 240
        while True:
            st = job.status()
            workers = {r["node"]: r for r in st["roles"] if r["role"] == "worker"}
            if len(workers) == 3 and all(r["step_rate"] > 0 for r in workers.values()) and workers["slow"]["straggler"]:
                break
            assert st["state"] in ("queued", "starting", "running"), st
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
        as_json = json.loads(_gossamer("status", job.id, "--json", "-c", address))
        text = _gossamer("status", job.id, "-c", address)
        metrics = scrape(f"{base}/metrics")
        page = json.loads(get(f"{base}/api/status")[2])
    finally:
        job.cancel()
        client.close()

    rates = {n: r["step_rate"] for n, r in workers.items()}
    assert rates["slow"] < 0.5 * rates["fast0"] and rates["slow"] < 0.5 * rates["fast1"], rates
    assert not workers["fast0"]["straggler"] and not workers["fast1"]["straggler"]

    flagged = {r["node"] for r in as_json["roles"] if r["role"] == "worker" and r["straggler"]}
    assert flagged == {"slow"}, as_json["roles"]
    assert "stragglers" in text and "slow (" in text and "slow (straggler)" in text, text

    for node in ("fast0", "fast1", "slow"):
        assert value(metrics, "gossamer_node_straggler", experiment=job.id, node=node) == (node == "slow")
        assert value(metrics, "gossamer_node_step_rate", experiment=job.id, node=node) > 0

    exp = next(e for e in page["experiments"] if e["id"] == job.id)
    assert exp["stragglers"] == ["slow"]
    assert {n["name"] for n in page["nodes"] if n["straggler"]} == {"slow"}
