"""Staleness buckets as shards report them, a node agent's feed of role reports, and the status page's chart series."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gossamer.coordinator.http import series
from gossamer.core.metric_families import histogram_buckets, staleness_buckets, sum_buckets
from gossamer.node.node_metrics import MetricsFeed, NodeMetrics


def test_staleness_buckets_are_cumulative_with_sum_and_count() -> None:
    b = staleness_buckets({"0": 5, "1": 3, "3": 2, "100": 1})
    assert b["staleness_le_0"] == 5 and b["staleness_le_1"] == 8 and b["staleness_le_2"] == 8
    assert b["staleness_le_4"] == 10 and b["staleness_le_64"] == 10
    assert b["staleness_count"] == 11 and b["staleness_sum"] == 0 + 3 + 6 + 100
    assert histogram_buckets(b) == [("0", 5), ("1", 8), ("2", 8), ("4", 10), ("8", 10), ("16", 10), ("32", 10),
                                    ("64", 10), ("+Inf", 11)]
    assert histogram_buckets({"loss": 1.0}) is None


def test_histograms_of_two_replicas_add_up_bucket_by_bucket() -> None:
    a = histogram_buckets(staleness_buckets({"0": 1, "2": 1}))
    b = histogram_buckets(staleness_buckets({"1": 4}))
    assert a is not None and b is not None
    total = sum_buckets(sum_buckets(None, a), b)
    assert dict(total) == dict(histogram_buckets(staleness_buckets({"0": 1, "1": 4, "2": 1})) or [])


def _samples(m: NodeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_node_metrics_merge_reports_and_refuse_what_is_not_one() -> None:
    m = NodeMetrics("n1", roles=lambda: {("e", "worker", 0): 1})
    good = {"labels": {"experiment": "e", "role": "worker", "worker": 0, "rank": 0}, "step": 7,
            "values": {"updates": 7, "bytes_up": 100, "raw_bytes_up": 400, "loss": 0.5}}
    assert m.receive(json.dumps(good).encode())
    good["values"] = {"updates": 9}
    assert m.receive(json.dumps(good).encode())  # merged: bytes stay, steps move on
    for bad in (b"\xff\xfe", b"[]", b"{}", b"[" * 100_000, json.dumps({"labels": {"role": "worker"}, "values": {}}).encode(),
                json.dumps({"labels": {"experiment": "e", "role": "spy"}, "values": {}}).encode(),
                json.dumps({"labels": {"experiment": "e", "role": "ps"}, "values": {"x": "not a number"}}).encode()):
        assert not m.receive(bad)
    s = _samples(m)
    lab = (("experiment", "e"), ("node", "n1"), ("rank", "0"), ("worker", "0"))
    assert s[("gossamer_worker_steps_total", lab)] == 9
    assert s[("gossamer_worker_bytes_up_total", lab)] == 100
    assert s[("gossamer_worker_compression_ratio", lab)] == 4
    assert s[("gossamer_agent_bad_reports_total", (("node", "n1"),))] == 7
    assert s[("gossamer_agent_role_processes", (("experiment", "e"), ("index", "0"), ("node", "n1"),
                                                 ("role", "worker")))] == 1


def test_a_role_process_feed_reaches_the_agent_over_its_socket() -> None:
    async def scenario() -> tuple[list[int], dict[tuple[str, tuple[tuple[str, str], ...]], float], str]:
        m = NodeMetrics("n1")
        port = await m.start("127.0.0.1", 0)
        try:
            assert port > 0 and Path(m.socket_path).exists()
            assert Path(m.socket_path).parent.stat().st_mode & 0o077 == 0  # this user's processes only
            feed = MetricsFeed.for_spec({"metrics_socket": m.socket_path, "experiment_id": "e"}, "ps", shard=1)
            seen: list[int] = []
            report = feed.tee(lambda step, values: seen.append(step))
            report(3, {"ps_updates": 3.0, "loss": float("nan"), **staleness_buckets({"0": 2, "1": 1})})
            deadline = time.monotonic() + 5
            while not m.figures and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            feed.close()
            return seen, _samples(m), m.socket_path
        finally:
            await m.stop()

    seen, s, path = asyncio.run(scenario())
    lab = (("experiment", "e"), ("node", "n1"), ("shard", "1"))
    assert seen == [3] and s[("gossamer_shard_updates_total", lab)] == 3
    assert s[("gossamer_shard_staleness_count", lab)] == 3
    assert not Path(path).exists()  # its private directory is removed on stop


def test_a_feed_without_an_agent_drops_points_silently() -> None:
    with tempfile.TemporaryDirectory() as d:
        feed = MetricsFeed(str(Path(d) / "nobody.sock"), {"experiment": "e", "role": "worker"})
        feed.send(1, {"updates": 1.0})  # no listener: nothing raised, training goes on
        feed.close()
    MetricsFeed("", {}).send(1, {"updates": 1.0})  # not started by an agent with --metrics-port


def test_chart_series_average_loss_sum_throughput_and_keep_every_eval() -> None:
    rows = []
    for t in range(100):
        for w in ("a/0", "b/0"):
            rows.append((1000.0 + t, t, w, {"loss": 1.0 if w == "a/0" else 3.0, "samples_per_s": 50.0, "updates": t}))
        if t % 20 == 0:
            rows.append((1000.0 + t + 0.5, t, "a/0", {"eval_accuracy": t / 100, "eval_step": float(t)}))
    rows.append((1000.0 + 50, 50, "a/0", {"loss": float("nan")}))  # never plotted
    out = series(rows, start=1000.0, max_points=20)
    assert 15 <= len(out["loss"]) <= 21 and 15 <= len(out["samples_per_s"]) <= 21
    assert all(v == pytest.approx(2.0) for _, v in out["loss"][1:])
    assert all(v == pytest.approx(100.0) for _, v in out["samples_per_s"])
    assert [v for _, v in out["eval_accuracy"]] == [0.0, 0.2, 0.4, 0.6, 0.8]
    assert [x for x, _ in out["loss"]] == sorted(x for x, _ in out["loss"])
    assert out["steps"][-1][1] == 99
    assert series([], start=0.0) == {"loss": [], "samples_per_s": [], "steps": [], "eval_accuracy": []}


def test_chart_series_skip_a_long_quiet_stretch() -> None:
    rows = [(0.0, 0, "a/0", {"loss": 1.0}), (1.0, 1, "a/0", {"loss": 1.0}), (10_000.0, 2, "a/0", {"loss": 0.5})]
    out = series(rows, start=0.0, max_points=300)
    assert len(out["steps"]) <= 301
    assert out["loss"][-1][1] == 0.5



def test_feed_directories_of_killed_nodes_are_swept_and_live_or_young_ones_kept(tmp_path: Path) -> None:
    import os
    import socket

    from gossamer.node.node_metrics import FEED_PREFIX, sweep_stale_feeds

    def feed(name: str, *, live: bool, age_s: float) -> tuple[Path, socket.socket | None]:
        d = tmp_path / f"{FEED_PREFIX}{name}"
        d.mkdir()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(str(d / "feed.sock"))
        if not live:
            s.close()  # what SIGKILL leaves: the socket file, no reader
        t = time.time() - age_s
        os.utime(d, (t, t))
        return d, (s if live else None)

    dead, _ = feed("dead", live=False, age_s=600)
    live, sock = feed("live", live=True, age_s=600)
    young, _ = feed("young", live=False, age_s=1)
    other = tmp_path / "not-ours"
    other.mkdir()
    try:
        assert sweep_stale_feeds(str(tmp_path)) == 1
        assert not dead.exists() and live.exists() and young.exists() and other.exists()
    finally:
        assert sock is not None
        sock.close()
