"""A node's own Prometheus /metrics: role processes send their figures to the agent over a local datagram socket.

Each role process already reports its metrics to the coordinator once a second; it sends
the same values to its node agent as one JSON datagram on a Unix socket in a private
(0700) directory. A datagram never blocks the sender and a dropped one costs nothing (the
next carries the same cumulative counters), and a role process killed mid-send leaves no
lock held, which a shared queue or a multiprocess-mode metrics directory could.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gossamer.core.metric_families import counter as _counter
from gossamer.core.metric_families import gauge as _gauge
from gossamer.core.metric_families import histogram_buckets
from gossamer.transport.httpserver import HttpServer, Request, Response

log = logging.getLogger(__name__)

#: A datagram larger than this is not a report.
MAX_DATAGRAM = 64 * 1024
#: The per-node directory of the role-report socket, under the temp dir.
FEED_PREFIX = "gossamer-metrics-"
#: Distinct role processes remembered at once (a bound on what the feed socket can make us hold).
MAX_ROLES = 1024
#: A finished role's figures stay on /metrics this long.
KEEP_FINISHED_S = 300.0

Hook = Callable[[int, dict[str, float]], None]


# --- role process side -------------------------------------------------------------------
class MetricsFeed:
    """Sends a role process's metric points to its node agent (no-op without a socket path)."""

    def __init__(self, path: str, labels: dict[str, str | int]) -> None:
        self.path = path
        self.labels = labels
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @classmethod
    def for_spec(cls, spec: dict[str, Any], role: str, **labels: str | int) -> MetricsFeed:
        """The feed of a role process started by the agent with `spec`."""
        return cls(str(spec.get("metrics_socket", "")),
                   {"experiment": str(spec.get("experiment_id", "")), "role": role, **labels})

    def send(self, step: int, values: dict[str, float]) -> None:
        if self._sock is None:
            return
        clean = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        data = json.dumps({"labels": self.labels, "step": int(step), "values": clean,
                           "time_unix": time.time()}).encode()
        try:
            self._sock.sendto(data, self.path)
        except OSError:
            pass  # agent gone, socket buffer full, datagram too big: metrics are best effort

    def tee(self, hook: Hook) -> Hook:
        """`hook` (e.g. the coordinator reporter) plus this feed."""

        def both(step: int, values: dict[str, float]) -> None:
            hook(step, values)
            self.send(step, values)

        return both

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# --- agent side --------------------------------------------------------------------------
@dataclass
class _RoleFigures:
    labels: dict[str, str]
    values: dict[str, float] = field(default_factory=dict)
    step: int = 0
    seen: float = 0.0  # the agent's clock


def sweep_stale_feeds(tmp: str | None = None, min_age_s: float = 60.0, now: float | None = None) -> int:
    """Remove this user's feed directories whose node is gone; how many.

    A node killed with SIGKILL (a vanished machine, a chaos test) cannot remove its own: each
    start removes those older than `min_age_s` whose socket no process holds any more.
    """
    tmp = tmp or tempfile.gettempdir()
    now = time.time() if now is None else now
    removed = 0
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if not name.startswith(FEED_PREFIX):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < min_age_s:
            continue  # another user's, or a node may be starting in it
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(os.path.join(path, "feed.sock"))
                continue  # someone still reads it
            except (ConnectionRefusedError, FileNotFoundError):
                pass
            except OSError:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


class NodeMetrics:
    """The agent's view of its role processes, served as Prometheus text on /metrics.

    Args:
        node_name: this node's name (a label on every metric).
        roles: returns {(experiment, role name, index): number of processes} running now.
    """

    def __init__(self, node_name: str, roles: Callable[[], dict[tuple[str, str, int], int]] | None = None) -> None:
        self.node_name = node_name
        self.node_id = ""
        self.roles = roles or dict
        self.role_failures = 0
        self.bad_reports = 0
        self.figures: dict[tuple[tuple[str, str], ...], _RoleFigures] = {}
        self._dir = ""
        self.socket_path = ""  # where role processes send their reports, once started
        self._sock: socket.socket | None = None
        self._http: HttpServer | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    async def start(self, host: str, port: int) -> int:
        """Open the feed socket and serve /metrics and /healthz; returns the bound HTTP port."""
        import asyncio

        sweep_stale_feeds()
        self._dir = tempfile.mkdtemp(prefix=FEED_PREFIX)  # mode 0700: this user's processes only
        self.socket_path = os.path.join(self._dir, "feed.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(self.socket_path)
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)
        self._http = HttpServer({"/metrics": self._metrics, "/healthz": self._healthz}, host=host, port=port)
        return await self._http.start()

    async def stop(self) -> None:
        import asyncio

        if self._http is not None:
            await self._http.stop()
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _drain(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.receive(data)

    def receive(self, data: bytes, now: float | None = None) -> bool:
        """Merge one datagram from a role process; False (and counted) if it is not a valid report."""
        try:
            msg = json.loads(data)
            labels = {str(k): str(v) for k, v in msg["labels"].items()}
            values = {str(k): float(v) for k, v in msg["values"].items()}
            step = int(msg.get("step", 0))
            if not labels.get("experiment") or labels.get("role") not in ("worker", "ps"):
                raise ValueError("labels must name the experiment and the role")
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            self.bad_reports += 1
            return False
        key = tuple(sorted(labels.items()))
        if key not in self.figures and len(self.figures) >= MAX_ROLES:
            self.bad_reports += 1
            return False
        fig = self.figures.setdefault(key, _RoleFigures(labels=labels))
        fig.labels = labels
        fig.values.update(values)
        fig.step = max(fig.step, step)
        fig.seen = time.time() if now is None else now
        return True

    def role_failed(self) -> None:
        self.role_failures += 1

    async def _metrics(self, req: Request) -> Response:
        return Response(generate_latest(self.registry), content_type=CONTENT_TYPE_LATEST)

    async def _healthz(self, req: Request) -> Response:
        return Response.text("ok\n")

    # --- the collector -----------------------------------------------------------------
    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        running = self.roles()
        live_exps = {k[0] for k in running}
        for key, fig in list(self.figures.items()):
            if fig.labels.get("experiment") not in live_exps and now - fig.seen > KEEP_FINISHED_S:
                del self.figures[key]
        node = self.node_name
        yield _gauge("gossamer_agent_info", "This node agent (value 1).", ["node", "node_id"],
                     [([node, self.node_id], 1.0)])
        yield _gauge("gossamer_agent_role_processes", "Role processes running on this node.",
                     ["node", "experiment", "role", "index"],
                     [([node, exp, role, str(index)], float(n)) for (exp, role, index), n in sorted(running.items())])
        yield _counter("gossamer_agent_role_failures", "Role processes that exited with an error.",
                       ["node"], [([node], float(self.role_failures))])
        yield _counter("gossamer_agent_bad_reports", "Datagrams on the feed socket that were not valid reports.",
                       ["node"], [([node], float(self.bad_reports))])
        workers = [f for f in self.figures.values() if f.labels["role"] == "worker"]
        shards = [f for f in self.figures.values() if f.labels["role"] == "ps"]
        yield from self._worker_metrics(workers, now)
        yield from self._shard_metrics(shards)

    def _worker_metrics(self, figs: list[_RoleFigures], now: float) -> Iterator[Metric]:
        names = ["node", "experiment", "worker", "rank"]

        def rows(key: str) -> list[tuple[list[str], float]]:
            return [(self._lv(f, "worker", "rank"), f.values[key]) for f in figs if key in f.values]

        yield _counter("gossamer_worker_steps", "Training steps this worker process has taken.", names, rows("updates"))
        yield _counter("gossamer_worker_samples", "Samples this worker has trained on (rank 0: the node's).",
                       names, rows("samples"))
        yield _counter("gossamer_worker_bytes_up", "Bytes sent to the shards (on the wire, compressed).",
                       names, rows("bytes_up"))
        yield _counter("gossamer_worker_bytes_down", "Bytes received from the shards (on the wire).",
                       names, rows("bytes_down"))
        yield _gauge("gossamer_worker_samples_per_second", "Training throughput over the last report interval.",
                     names, rows("samples_per_s"))
        yield _gauge("gossamer_worker_loss", "Training loss of the last step.", names, rows("loss"))
        yield _gauge("gossamer_worker_eval_accuracy", "Accuracy of the last evaluation (the lead worker).",
                     names, rows("eval_accuracy"))
        ratio = [(self._lv(f, "worker", "rank"), f.values["raw_bytes_up"] / f.values["bytes_up"])
                 for f in figs if f.values.get("bytes_up") and "raw_bytes_up" in f.values]
        yield _gauge("gossamer_worker_compression_ratio", "Uncompressed / sent bytes of pushes.", names, ratio)
        yield _gauge("gossamer_worker_report_age_seconds", "Seconds since this process last reported.",
                     names, [(self._lv(f, "worker", "rank"), now - f.seen) for f in figs])

    def _shard_metrics(self, figs: list[_RoleFigures]) -> Iterator[Metric]:
        names = ["node", "experiment", "shard"]

        def rows(key: str) -> list[tuple[list[str], float]]:
            return [(self._lv(f, "shard"), f.values[key]) for f in figs if key in f.values]

        yield _counter("gossamer_shard_updates", "Updates this shard has applied.", names, rows("ps_updates"))
        yield _counter("gossamer_shard_bytes_in", "Bytes this shard received.", names, rows("ps_bytes_in"))
        yield _counter("gossamer_shard_bytes_out", "Bytes this shard sent.", names, rows("ps_bytes_out"))
        yield _counter("gossamer_shard_errors", "Requests this shard refused as malformed.", names, rows("ps_errors"))
        yield _gauge("gossamer_shard_primary", "1 while this replica is the primary, 0 while a backup.",
                     names, rows("primary"))
        discarded = CounterMetricFamily("gossamer_shard_discarded_updates", "Updates not applied, by cause.",
                                        labels=[*names, "cause"])
        for f in figs:
            for k, v in f.values.items():
                if k.startswith("discarded_"):
                    discarded.add_metric([*self._lv(f, "shard"), k.removeprefix("discarded_")], v)
        yield discarded
        hist = HistogramMetricFamily("gossamer_shard_staleness",
                                     "Staleness (versions) of the updates this shard applied.", labels=names)
        for f in figs:
            buckets = histogram_buckets(f.values)
            if buckets is not None:
                hist.add_metric(self._lv(f, "shard"), buckets, sum_value=f.values.get("staleness_sum", 0.0))
        yield hist

    def _lv(self, f: _RoleFigures, *extra: str) -> list[str]:
        return [self.node_name, f.labels.get("experiment", ""), *(f.labels.get(k, "") for k in extra)]

