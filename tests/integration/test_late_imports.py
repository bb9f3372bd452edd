"""A fresh node's first role is forked before its fork server's late imports; an idle (standby) node does them too."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gossamer import Client, zygote
from gossamer.local_cluster import LocalCluster
from gossamer.worker.late_imports import SIGNAL

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


def _until(what: str, check: Callable[[], bool], timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_first_role_is_forked_before_the_late_imports_and_a_standby_does_them_when_idle(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    client = Client(address)
    nodes = {name: cluster.add_node(name, spot=name != "ps", env=OWN_FORK_SERVER) for name in ("ps", "w0", "standby")}
    servers = {}
    for name, proc in nodes.items():
        _until(f"{name}'s fork server", lambda: _fork_server(proc.pid) is not None)
        servers[name] = _fork_server(proc.pid)
    job = client.submit({"name": "late", "mode": "async", "model": "gossamer.examples.digits:mlp",
                         "dataset": "gossamer.examples.digits:data", "num_ps_shards": 1, "ps_backup": False,
                         "num_workers": 1, "min_workers": 1, "max_workers": 1, "total_steps": 100000,
                         "eval_every": 0, "checkpoint_every": 0})
    # Poll both facts each round: which came first is what the test asserts.
    first_role: dict[str, float] = {}
    late: dict[str, float] = {}
    for name in ("ps", "w0"):
        pid = servers[name]
        assert pid is not None

        def seen(name: str = name, pid: int = pid) -> bool:
            now = time.monotonic()
            if name not in first_role and _children(pid):
                first_role[name] = now
            if name not in late and _signal_state(pid)[1]:
                late[name] = now
            return name in first_role and name in late
        _until(f"{name}'s first role and late imports", seen)
        # Late imports before the fork would have held the role for their seconds (1.7 s of dynamo alone).
        assert first_role[name] <= late[name], (name, first_role[name], late[name])
    st = job.status()
    assert st["state"] == "running", st
    # The standby got no role: its server imports the rest once idle, and had the handler until then.
    standby = servers["standby"]
    assert standby is not None and not _children(standby)
    installed, ran = _signal_state(standby)
    assert installed or ran
    _until("the standby's late imports", lambda: _signal_state(standby)[1])
    assert not _children(standby)
    job.cancel()
