"""Failure detection with real signals: kill -9 is seen within two heartbeats, a frozen machine by its lease."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster

pytestmark = pytest.mark.timeout(120)


def _state(client: Client, name: str) -> str:
    return next((n["state"] for n in client.nodes() if n["name"] == name), "absent")


def _wait_state(client: Client, name: str, state: str, timeout: float) -> float:
    t0 = time.monotonic()
    while _state(client, name) != state:
        assert time.monotonic() - t0 < timeout, f"{name} not {state} after {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - t0


def _wait_heartbeat(client: Client, name: str, timeout: float) -> None:
    """Until the coordinator has renewed `name`'s lease by a heartbeat (its lease age went down)."""
    def age() -> float:
        return next(n["lease_age_s"] for n in client.nodes() if n["name"] == name)

    t0, last = time.monotonic(), age()
    while (now := age()) >= last:
        assert time.monotonic() - t0 < timeout, f"no heartbeat from {name} in {timeout}s"
        last = now
        time.sleep(0.05)


def test_kill9_is_detected_fast_and_a_frozen_node_by_its_lease(tmp_path, make_cluster: MakeCluster) -> None:  # type: ignore[no-untyped-def]
    lease = 4.0
    with make_cluster(state_dir=tmp_path / "state", heartbeat_interval=0.5, lease_timeout=lease) as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("dies")
        frozen = cluster.add_node("freezes")
        _wait_state(client, "dies", "ready", 60)
        _wait_state(client, "freezes", "ready", 60)
        # Ready counts from the Join; a node killed before it opened its assignment stream is seen
        # by its lease only. The stream opens before the first heartbeat is sent: wait for one.
        _wait_heartbeat(client, "dies", 30)
        _wait_heartbeat(client, "freezes", 30)

        cluster.kill_node("dies")  # the process is gone: its connections close at once
        killed = _wait_state(client, "dies", "lost", lease + 5)
        assert killed < lease, f"kill -9 took {killed:.2f}s to detect, no better than the {lease}s lease"

        os.killpg(frozen.pid, signal.SIGSTOP)  # alive but silent: connections stay open
        try:
            stopped = _wait_state(client, "freezes", "lost", lease + 5)
        finally:
            os.killpg(frozen.pid, signal.SIGCONT)
        assert stopped >= lease - 1.0, f"a frozen node was declared lost after {stopped:.2f}s, before its lease"
        # Thawed, it finds it was declared lost and joins again as a fresh node.
        _wait_state(client, "freezes", "ready", 30)
    events = [(e["time"], e["kind"], e["message"]) for e in _events(tmp_path / "state")]
    assert any(k == "lost" and "dies connection closed" in m for _, k, m in events), events
    assert any(k == "lost" and "freezes lease expired" in m for _, k, m in events), events


def _events(state_dir):  # type: ignore[no-untyped-def]
    import asyncio

    from gossamer.coordinator.store import Store

    store = Store(state_dir)
    try:
        return asyncio.run(store.events())
    finally:
        store.close()
