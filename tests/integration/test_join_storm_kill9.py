"""A join storm against a real `coordinator serve` killed -9 mid-storm, its commits held: every join it acknowledged is on disk (group commit, coordinator/group_commit.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from gossamer.coordinator.store import Store
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)
JOINS = 600


def _serve(state: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = state / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "gossamer.tools.cli", "coordinator", "serve", "--port", "0",
                             "--state-dir", str(state), "--rate-limit", "0", "--no-import-check", "--no-udp-beats",
                             "--ready-file", str(ready), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the coordinator did not start"
        time.sleep(0.05)
    return proc, f"127.0.0.1:{ready.read_text()}"


async def _storm(address: str, proc: subprocess.Popen[bytes], db: Path) -> tuple[list[str], int]:
    """JOINS joins, one every 2 ms; once a third are answered the test holds the database's write lock
    (commits wait, as on a slow disk) for a second, then kills the coordinator -9 and lets go.
    (ids answered, in order; calls that failed)."""
    acked: list[str] = []
    third = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.NodeServiceStub(ch)
        await stub.ListNodes(pb.ListNodesRequest(), timeout=30)  # connected before the storm

        async def join(k: int) -> None:
            resp = await stub.Join(pb.JoinRequest(name=f"storm-{k}", address="127.0.0.1", node_id=f"storm{k:04d}"),
                                   timeout=60)
            acked.append(resp.node_id)
            if len(acked) >= JOINS // 3:
                third.set()

        async def kill() -> None:
            await third.wait()
            lock = await asyncio.to_thread(_write_lock, db)
            try:
                await asyncio.sleep(1.0)  # joins arrive and wait for their commit: none may be answered
                os.kill(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 30)
            finally:
                await asyncio.to_thread(lock.close)  # rolled back: it wrote nothing

        killer = asyncio.create_task(kill())
        calls = []
        for k in range(JOINS):
            calls.append(asyncio.create_task(join(k)))
            await asyncio.sleep(0.002)
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        await killer
    return acked, sum(1 for o in outcomes if isinstance(o, BaseException))


def _write_lock(db: Path) -> sqlite3.Connection:
    """A connection holding `db`'s write lock (BEGIN IMMEDIATE) until it is closed."""
    conn = sqlite3.connect(db, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_every_acknowledged_join_survives_a_kill_9_mid_storm(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc, address = _serve(state)
    try:
        acked, failed = asyncio.run(_storm(address, proc, state / "coordinator.sqlite"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) >= JOINS // 3 and failed > 0, (len(acked), failed)  # the kill came mid-storm
    store = Store(state)  # what a restarted coordinator loads
    try:
        nodes = {n.id: n for n in store.load()[0]}
        joined = {e["node_id"] for e in asyncio.run(store.events()) if e["kind"] == "join"}
    finally:
        store.close()
    missing = [i for i in acked if i not in nodes]
    assert not missing, f"{len(missing)} acknowledged joins lost: {missing[:5]}"
    assert set(acked) <= joined  # each with its event: one transaction
    assert all(nodes[i].name == f"storm-{int(i[5:])}" for i in acked)
