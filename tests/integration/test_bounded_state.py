"""Bounded coordinator state: a day of metrics plots within bounded answers (shape kept), old points are
downsampled, and finished experiments, lost nodes and old events are pruned after their retention."""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from gossamer import Client
from gossamer.coordinator.metric_query import DEFAULT_MAX_POINTS
from gossamer.coordinator.retention import housekeep
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import InProcessCoordinator, StartCoordinator
from tests.chaos._wait import wait_for

pytestmark = pytest.mark.timeout(600)
T = TypeVar("T")

DAY_S = 86400
SOURCES = ("n1/0", "n2/0", "n3/0", "n4/ps0")
PERIOD_S = 3600.0
SPIKE_AT = 43_210  # seconds into the day: one point of one source reads 100
GRPC_LIMIT = 4 << 20  # the client's default largest message


def _slow(c: InProcessCoordinator, coro: Coroutine[Any, Any, T]) -> T:
    """`c.call` with room for a loaded machine: a day of points is a third of a million rows."""
    return asyncio.run_coroutine_threadsafe(coro, c.loop).result(300)


def _loss(source: str, t: float) -> float:
    return 100.0 if source == SOURCES[0] and t == SPIKE_AT else math.sin(2 * math.pi * t / PERIOD_S)


def _write_day(c: InProcessCoordinator, exp_id: str, start: float) -> None:
    """A day at 1 Hz from every source, written straight into the coordinator's SQLite store."""
    for hour in range(24):
        rows = [(start + t, t, src, {"loss": _loss(src, t), "samples_per_s": 100.0 + (t % 7),
                                     "bytes_up": float(t * 1000), "samples": float(t * 32)})
                for t in range(hour * 3600, (hour + 1) * 3600) for src in SOURCES]
        _slow(c, c.server.coord.store.add_metrics(exp_id, rows))


def _pages(address: str, exp_id: str, max_points: int = 0) -> list[pb.GetMetricsResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ExperimentServiceStub(channel)
        pages, token = [], ""
        while True:
            resp = stub.GetMetrics(pb.GetMetricsRequest(experiment_id=exp_id, max_points=max_points,
                                                        page_token=token), timeout=60)
            pages.append(resp)
            token = resp.next_page_token
            if not token:
                return pages


def _submitted(c: InProcessCoordinator) -> str:
    return Client(c.address).submit({"name": "day", "model": "gossamer.examples.digits:mlp",
                                     "dataset": "gossamer.examples.digits:data", "total_steps": 10}).id


def test_a_day_of_metrics_plots_in_bounded_paged_answers_keeping_its_shape(start_coordinator: StartCoordinator) -> None:
    c = start_coordinator(http=True, check_imports=False, metrics_retention_s=0)
    exp_id = _submitted(c)
    start = time.time() - DAY_S - 60
    _write_day(c, exp_id, start)

    pages = _pages(c.address, exp_id)
    points = [p for page in pages for p in page.points]
    assert all(page.ByteSize() < GRPC_LIMIT // 4 for page in pages), [page.ByteSize() for page in pages]
    assert len(points) <= DEFAULT_MAX_POINTS and len(points) >= DEFAULT_MAX_POINTS // 2, len(points)
    assert pages[0].bucket_s > 0
    assert sum(p.count for p in points) == DAY_S * len(SOURCES)  # every stored point is in exactly one bucket
    # The shape survives: the one-point spike is the max of its bucket, the sine's extremes are kept,
    # and each bucket's mean follows the sine at the bucket's middle.
    assert max(p.max_values["loss"] for p in points) == 100.0
    assert min(p.min_values["loss"] for p in points) == pytest.approx(-1.0, abs=1e-6)
    assert max(p.max_values["loss"] for p in points if p.source != SOURCES[0]) == pytest.approx(1.0, abs=1e-6)
    width = pages[0].bucket_s
    for p in points:
        if p.source == SOURCES[1]:
            mid = p.time_unix - start - width / 2
            assert abs(p.values["loss"] - math.sin(2 * math.pi * mid / PERIOD_S)) < 0.2, (p, mid)

    # The Python client pages through the same answer; `gossamer plot` reads it that way.
    from_client = Client(c.address).job(exp_id).metrics()
    assert len(from_client) == len(points) and from_client[0]["count"] > 1
    assert max(p["max"]["loss"] for p in from_client) == 100.0

    # A small range is answered as reported.
    recent = Client(c.address).job(exp_id).metrics(since_unix=start + DAY_S - 10)
    assert len(recent) == 9 * len(SOURCES) and all("count" not in p for p in recent)

    # The status page's series: bounded by max_points, and the loss still swings over [-1, 1].
    with urllib.request.urlopen(f"{c.base}/api/series?experiment={exp_id}&max_points=200", timeout=60) as r:
        body = r.read()
    series = json.loads(body)
    assert len(body) < 64 << 10, len(body)
    assert 100 <= len(series["loss"]) <= 201 and 100 <= len(series["steps"]) <= 201
    losses = [v for _, v in series["loss"]]
    assert min(losses) < -0.5 and max(losses) > 0.5
    assert series["steps"][-1][1] == DAY_S - 1


def test_old_metric_points_are_downsampled_keeping_min_max_and_mean(start_coordinator: StartCoordinator) -> None:
    c = start_coordinator(check_imports=False, metrics_retention_s=6 * 3600, metrics_bucket_s=60)
    exp_id = _submitted(c)
    # The day ends an hour from now: the coordinator's own passes (cutoff: now - 6 h) stay short of
    # the pass below (cutoff: the day's end - 6 h), and merge the same 60 s buckets when they run.
    start = math.floor((time.time() - DAY_S + 3600) / 60) * 60
    _write_day(c, exp_id, start)
    store = c.server.coord.store
    _slow(c, housekeep(c.server.coord, now=start + DAY_S))
    after = c.call(store.count("metrics"))
    # 18 h merged into one row per 60 s per source; the newest 6 h kept as reported.
    assert after == (18 * 60 + 6 * 3600) * len(SOURCES), after
    before = DAY_S * len(SOURCES)
    points = Client(c.address).job(exp_id).metrics(max_points=10**6)  # no read-time merge: what is stored
    merged = [p for p in points if p.get("count", 1) > 1]
    assert merged and all(p["count"] <= 60 for p in merged)
    assert sum(p.get("count", 1) for p in points) == before
    spike = [p for p in merged if p["max"]["loss"] == 100.0]
    assert len(spike) == 1 and spike[0]["source"] == SOURCES[0]
    assert spike[0]["min"]["loss"] < spike[0]["loss"] < 100.0  # the mean, between the extremes
    assert _slow(c, housekeep(c.server.coord, now=start + DAY_S)).metric_rows_merged == 0  # nothing left


def test_finished_experiments_lost_nodes_and_old_events_are_pruned(start_coordinator: StartCoordinator) -> None:
    # The coordinator's own retention task does the pruning (it runs every tenth of the shortest period).
    c = start_coordinator(check_imports=False, finished_retention_s=0.5, lost_node_retention_s=0.5,
                          event_retention_s=3600, metrics_retention_s=0)
    client = Client(c.address)
    store = c.server.coord.store
    stale_event = time.time() - 7200
    c.call(store.run(lambda db: db.execute(
        "INSERT INTO events (time, experiment_id, node_id, kind, message) VALUES (?, '', '', 'old', 'x')",
        (stale_event,))))
    with grpc.insecure_channel(c.address) as channel:  # a node that joins and falls silent
        node_id = pb_grpc.NodeServiceStub(channel).Join(pb.JoinRequest(name="gone", address="127.0.0.1"),
                                                        timeout=10).node_id
    wait_for(lambda: any(e["kind"] == "lost" and e["node_id"] == node_id for e in c.call(store.events())), 60,
             "the node declared lost")
    old = client.submit({"name": "old", "model": "m:f", "dataset": "d:f", "total_steps": 10})
    keep = client.submit({"name": "keep", "model": "m:f", "dataset": "d:f", "total_steps": 10})
    c.call(store.add_metrics(old.id, [(time.time(), 1, "n/0", {"loss": 1.0})]))
    old.cancel()
    wait_for(lambda: node_id not in {n["id"] for n in client.nodes()}, 60, "the lost node forgotten")
    wait_for(lambda: [e["id"] for e in client.experiments()] == [keep.id], 60, "the cancelled experiment forgotten")
    wait_for(lambda: all(e["kind"] != "old" for e in c.call(store.events())), 60, "the stale event deleted")
    events = c.call(store.events())
    assert any(e["kind"] == "lost" and e["node_id"] == node_id for e in events), events  # events have their own
    assert all(e["experiment_id"] != old.id for e in events)
    assert any(e["experiment_id"] == keep.id for e in events)
    assert c.call(store.metrics(old.id)) == []
    assert client.job(keep.id).status()["state"] == "queued"  # an active experiment is never pruned
    # A restarted coordinator does not bring them back.
    state = Path(c.config.state_dir)
    c.close()
    again = start_coordinator(state, check_imports=False)
    assert [e["id"] for e in Client(again.address).experiments()] == [keep.id]
    assert node_id not in {n["id"] for n in Client(again.address).nodes()}
