"""Helpers of the observability tests: a cluster serving HTTP on free ports, scraping and parsing /metrics."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import DIGITS

#: Every process of the cluster: the coordinator serves the status page and /metrics, each node
#: its own /metrics, all on free ports.
HTTP_ENV = {"GOSSAMER_HTTP_PORT": "0", "GOSSAMER_METRICS_PORT": "0"}
#: About ten times a normal digits step on this machine: a clear straggler.
SLOW = {"GOSSAMER_FAULT": "delay:seconds=0.2"}


def http_port(cluster: LocalCluster) -> int:
    """The coordinator's HTTP port (written to STATE_DIR/http.port before it reports ready)."""
    return int((cluster.state_dir / "http.port").read_text())


def node_metrics_port(cluster: LocalCluster, name: str, timeout: float = 60.0) -> int:
    """A node's /metrics port, from the line its agent logs once serving."""
    log = Path(cluster.log_dir) / f"{name}.log"
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(r"node metrics on http://[^:]+:(\d+)/metrics", log.read_text() if log.exists() else "")
        if m:
            return int(m.group(1))
        assert time.monotonic() < deadline, f"{name} never served /metrics:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def get(url: str, timeout: float = 10.0) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a /metrics page, parsed by prometheus_client."""
    status, ctype, body = get(url)
    assert status == 200 and ctype.startswith("text/plain"), (status, ctype, body[:500])
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (AssertionError unless exactly one)."""
    hits = [v for (n, lv), v in samples.items() if n == name and set(labels.items()) <= set(lv)]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


def wait_ready(client: Client, n: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(x["state"] == "ready" for x in client.nodes()) < n:
        assert time.monotonic() < deadline, client.nodes()
        time.sleep(0.2)


def digits(name: str, workers: int, **kw: Any) -> dict[str, Any]:
    """An async digits experiment that runs until cancelled (unless total_steps is given)."""
    return {"name": name, **DIGITS, "mode": "async", "num_ps_shards": 1, "min_workers": workers, "max_workers": workers,
            "total_steps": 1_000_000, "eval_every": 100, **kw}


def wait_steps(job: Any, steps: int, timeout: float = 240.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (st := job.status())["steps"] < steps:
        assert st["state"] in ("queued", "starting", "running"), st
        assert time.monotonic() < deadline, st
        time.sleep(0.3)
    return st
