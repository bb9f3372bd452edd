"""Lease-based fencing under a real partition: the primary shard's host loses its link for
longer than the lease; its backup is promoted at the next epoch; the link comes back; the run completes with
no acknowledged update lost and no shard epoch answered by two primaries.

Hosts are network namespaces on one bridge (bench/_netns.py): h0 the coordinator (and the follower that
submits and records the run), h1 and h2 the shard hosts, h3 and h4 the workers. Needs root and `ip netns`
(skipped otherwise, with the reason).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from bench import _netns

REPO = Path(__file__).resolve().parents[2]

WHY = _netns.unavailable_reason()
# quiet: its 4 s lease is the point of the test, and in the parallel pass the suite's own load
# left a shard host's heartbeat thread unscheduled for 3.0 s (logged by the agent) at the start.
pytestmark = [pytest.mark.timeout(480), pytest.mark.quiet,
              pytest.mark.skipif(WHY is not None, reason=f"network namespaces unavailable: {WHY}")]

PY = sys.executable
HEARTBEAT_S, LEASE_S = 0.5, 4.0
SPEC = {"name": "partition", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "ps_backup": True, "min_workers": 2,
        "max_workers": 2, "total_steps": 1500, "eval_every": 0}


def _cli(*args: str) -> list[str]:
    return [PY, "-m", "gossamer.tools.cli", *args]


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _wait(path: Path, pred: Any, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        doc = _read(path)
        assert "error" not in doc, doc
        if doc and pred(doc):
            return doc
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {doc.get('status')}"
        time.sleep(0.2)


def _link(net: _netns.Topology, host: int, state: str) -> None:
    h = net.hosts[host]
    subprocess.run(["ip", "-n", h.ns, "link", "set", h.ifname, state], check=True, capture_output=True)


def test_a_partitioned_primary_is_fenced_and_no_acknowledged_update_is_lost(tmp_path: Path) -> None:
    prefix = f"{_netns.BASE_PREFIX}{os.getpid()}-f-"
    env = {**os.environ, "PYTHONPATH": str(REPO), "GOSSAMER_THREADS": "1"}
    slow = {**env, "GOSSAMER_FAULT": "delay:seconds=0.02"}
    out, ready = tmp_path / "follow.json", tmp_path / "coordinator.port"
    with _netns.Topology(5, prefix=prefix) as net:
        h0 = net.hosts[0]
        net.spawn(0, _cli("coordinator", "serve", "--host", h0.addr, "--port", "0", "--state-dir",
                          str(tmp_path / "state"), "--ready-file", str(ready), "--heartbeat-interval", str(HEARTBEAT_S),
                          "--lease-timeout", str(LEASE_S), "--no-import-check"),
                  log=tmp_path / "coordinator.log", env=env, cwd=str(REPO))
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.05)
        address = f"{h0.addr}:{int(ready.read_text())}"
        names = {1: "ps1", 2: "ps2", 3: "w3", 4: "w4"}
        for i, name in names.items():
            spot = ["--spot"] if name.startswith("w") else []
            net.spawn(i, _cli("worker", "join", address, "--name", name, "--address", net.hosts[i].addr, "--threads",
                              "1", *spot), log=tmp_path / f"{name}.log", env=slow if spot else env, cwd=str(REPO))
        net.spawn(0, [PY, "-m", "tests.netns._partition_follow", "--coordinator", address, "--spec", json.dumps(SPEC),
                      "--nodes", "4", "--out", str(out), "--timeout", "360"],
                  log=tmp_path / "follow.log", env=env, cwd=str(REPO))

        def serving(doc: dict[str, Any]) -> bool:
            st = doc["status"]
            ps = [r for r in st["roles"] if r["role"] == "ps" and r["endpoint"]]
            return st["state"] == "running" and st["steps"] >= 200 and len(ps) == 2

        doc = _wait(out, serving, 240, "200 steps with both replicas serving")
        assert doc["status"]["steps"] < SPEC["total_steps"] - 300, "the run outpaced the partition"
        primary = next(r for r in doc["status"]["roles"] if r["role"] == "ps" and r["replica"] == 0)
        cut = next(i for i, n in names.items() if n == primary["node"])
        _link(net, cut, "down")
        t_cut = time.monotonic()
        try:
            doc = _wait(out, lambda d: any(e["kind"] == "promote" for e in d["events"]), 60, "the backup's promotion")
            while time.monotonic() - t_cut < LEASE_S + 3.0:  # cut for well over the lease
                time.sleep(0.1)
        finally:
            _link(net, cut, "up")
        cut_s = time.monotonic() - t_cut
        doc = _wait(out, lambda d: d.get("final"), 300, "the end of the run")
        cut_log = (tmp_path / f"{names[cut]}.log").read_text()
    events = doc["events"]
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert doc["status"]["state"] == "completed", (doc["status"], text)
    promotions = [e["message"] for e in events if e["kind"] == "promote"]
    assert len(promotions) == 1 and "at epoch 1" in promotions[0], text
    # The isolated primary stopped acknowledging on its own once its lease lapsed, before the coordinator
    # promoted its backup, and was fenced for good when, back on the network, it heard it had been counted lost.
    fenced_at = _logged_at(cut_log, "lease lapsed (epoch 0)")
    promoted_at = next(e["time_unix"] for e in events if e["kind"] == "promote")
    assert fenced_at < promoted_at, (fenced_at, promoted_at, text)
    assert "fencing its shards" in cut_log, cut_log[-4000:]
    m = doc["metrics"]
    # No shard epoch answered from two endpoints, and no worker saw the shard's version go back.
    assert m.get("split_acks", 0.0) == 0.0, m
    assert m.get("versions_regressed", 0.0) == 0.0 and m.get("versions_lost", 0.0) == 0.0, m
    # Every acknowledged update is applied: the shard stops at total_steps applied updates, so the workers'
    # acknowledged pushes ('updates', summed) exceed it only by what a lost one forced them to push again
    # (and by each worker's last push, which the finished shard may answer without applying it).
    assert SPEC["total_steps"] <= m["updates"] <= SPEC["total_steps"] + SPEC["max_workers"], m
    print(f"link cut {cut_s:.1f} s (lease {LEASE_S} s); fenced {promoted_at - fenced_at:.2f} s before the promotion; "
          f"{promotions[0]}; acknowledged pushes {m['updates']:.0f} for {SPEC['total_steps']} steps; "
          f"{ {k: m.get(k) for k in ('shard_retries', 'stale_replies', 'resent', 'ps_unreplicated')} }")


def _logged_at(log: str, needle: str) -> float:
    """The time (unix) of the first log line holding `needle` (the text format's local timestamp)."""
    line = next((x for x in log.splitlines() if needle in x), None)
    assert line is not None, f"{needle!r} not logged: {log[-4000:]}"
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
