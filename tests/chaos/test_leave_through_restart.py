"""A node told to leave while the coordinator is down: its Leave is sent again until the restarted coordinator answers, so it is counted as left (its shards handed over at once), not lost when its lease runs out, however long the coordinator was down."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from gossamer.tools.local_cluster import LocalCluster
from tests.chaos._wait import wait_for, wait_for_line

pytestmark = pytest.mark.timeout(300)


def _retried_s(log: Path) -> int:
    """How long the node said it has been retrying its Leave (0 before it first says so)."""
    said = re.findall(r"Leave still not delivered after (\d+) s", log.read_text(errors="replace"))
    return max(map(int, said), default=0)


def test_a_leave_sent_while_the_coordinator_restarts_is_delivered(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "state") as cluster:
        cluster.start_coordinator(port=0)
        # A grace longer than any coordinator restart here (one took over 25 s on a loaded host): what is tested
        # is that the Leave gets through the restart, not how long a restart takes.
        node = cluster.add_node("leaver", env={"GOSSAMER_GRACE": "180"})
        log = cluster.log_dir / "leaver.log"
        wait_for_line(log, "joined 127.0.0.1", 60)  # its Join answered (listed is not enough: the reply may be in flight)
        cluster.kill_coordinator()
        node.send_signal(signal.SIGTERM)  # a spot notice while the coordinator is down
        wait_for_line(log, "Leave not delivered yet", 60)  # tried, and refused, before the restart
        # Down for 40 s of the node's own retries: gRPC's default reconnect backoff has by then grown
        # past the one lease (5 s) a restarted coordinator gives each node, so a channel without a
        # capped backoff dials the restarted coordinator too late and the node is counted lost.
        wait_for(lambda: _retried_s(log) >= 40, 120, "40 s of the node's Leave retries")
        assert node.poll() is None  # still trying, within its grace
        cluster.start_coordinator()  # same port and state
        assert node.wait(timeout=200) == 0
        with cluster.client() as client:
            states = {n["name"]: n["state"] for n in client.nodes()}
        assert states["leaver"] == "left", states  # answered before the node exited: not left for its lease
        assert "Leave delivered" in log.read_text(errors="replace")
