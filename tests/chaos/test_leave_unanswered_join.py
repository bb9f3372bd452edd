"""A node stopped while its Join is unanswered (the coordinator stalled): the coordinator serves that Join late, and the node's Leave under the same id follows it, so no phantom node is listed alive until its lease runs out."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from gossamer.tools.local_cluster import LocalCluster
from tests.chaos._wait import wait_for_line

pytestmark = pytest.mark.timeout(180)


def test_a_node_stopped_during_an_unanswered_join_is_listed_left_not_alive(tmp_path: Path) -> None:
    # The coordinator holds the Join 8 s, past the node's 5 s deadline; a long lease: without the
    # Leave, the phantom would stay listed alive (and could be given roles) for the whole of it.
    with LocalCluster(tmp_path / "state", lease_timeout=120.0, env={"GOSSAMER_FAULT": "hold:at=join:seconds=8"}) as cluster:
        cluster.start_coordinator(port=0)
        node = cluster.add_node("hasty")
        log = cluster.log_dir / "hasty.log"
        wait_for_line(cluster.log_dir / "coordinator.log", "holding 8 s at join", 60)  # the Join is in, unanswered
        node.send_signal(signal.SIGTERM)
        wait_for_line(log, "stopped before joining", 30)
        assert "DEADLINE_EXCEEDED" in log.read_text(errors="replace")  # its Join timed out, then it stopped
        assert node.wait(timeout=60) == 0
        with cluster.client() as client:
            states = {n["name"]: n["state"] for n in client.nodes()}
        # The late Join registered it (the test would prove nothing otherwise), and the Leave after it left it.
        assert states == {"hasty": "left"}, states
        assert "the coordinator had registered the unanswered Join" in log.read_text(errors="replace")
