"""A node's fork server imports dynamo and DCP before a role that needs them or once the node idles, never beside a running role."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from gossamer import Client
from gossamer.core import zygote
from gossamer.node.late_imports import SIGNAL
from gossamer.tools.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)

#: Each node starts its own fork server (the suite's shared zygote has imported everything already).
OWN_FORK_SERVER = {zygote.ENV: ""}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _fork_server(node_pid: int) -> int | None:
    return next((c for c in _children(node_pid) if b"forkserver" in _cmdline(c)), None)


def _signal_state(pid: int) -> tuple[bool, bool]:
    """(the late-import handler is installed, it ran: the signal is ignored now) from /proc/PID/status."""
    masks = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigCgt", "SigIgn"):
            masks[key] = int(value.strip(), 16)
    bit = 1 << (int(SIGNAL) - 1)
    return bool(masks["SigCgt"] & bit), bool(masks["SigIgn"] & bit)


def _has_fork_server(node_pid: int) -> bool:
    return _fork_server(node_pid) is not None


def _imported_late(server_pid: int) -> bool:
    return _signal_state(server_pid)[1]


def _until(what: str, check: Callable[[], bool], timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic()


@pytest.mark.quiet  # an idle node imports only while its host has a core to spare
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_late_imports_come_before_a_shard_never_beside_a_worker_and_when_the_node_idles(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    client = Client(address)
    nodes = {name: cluster.add_node(name, spot=name != "ps", env=OWN_FORK_SERVER) for name in ("ps", "spot0", "spot1")}
    servers: dict[str, int] = {}
    for name, proc in nodes.items():
        _until(f"{name}'s fork server", partial(_has_fork_server, proc.pid))
        server = _fork_server(proc.pid)
        assert server is not None
        servers[name] = server
    job = client.submit({"name": "late", "mode": "async", "model": "gossamer.examples.digits:mlp",
                         "dataset": "gossamer.examples.digits:data", "num_ps_shards": 1, "ps_backup": False,
                         "num_workers": 1, "min_workers": 1, "max_workers": 1, "total_steps": 1500,
                         "eval_every": 0, "checkpoint_every": 0})
    # The shard goes to the on-demand node, the worker to either spot node: the other is the standby.
    _until("both roles forked", lambda: sum(bool(_children(pid)) for pid in servers.values()) == 2)
    # A shard builds an optimizer (dynamo) and writes checkpoints (DCP): its fork server imported them first.
    assert _signal_state(servers["ps"])[1]
    worker = next(name for name, pid in servers.items() if name != "ps" and _children(pid))
    # An async worker needs neither, and while it runs its node's fork server imports nothing more: the
    # role would share those seconds of CPU.
    while job.status()["state"] not in ("completed", "failed", "cancelled"):
        if _children(servers[worker]):
            assert _signal_state(servers[worker]) == (True, False)
        time.sleep(0.05)
    assert job.status()["state"] == "completed"
    # Idle now (the standby all along): each imports the rest once the host has a core to spare.
    for name, pid in servers.items():
        _until(f"{name}'s late imports", partial(_imported_late, pid), timeout=180)
