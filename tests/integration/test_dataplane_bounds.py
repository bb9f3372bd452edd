"""A shard's (and a gossip peer's) memory is bounded whatever its peers do: peers that never read, invented senders, workers killed without LEAVE.

Real processes and sockets: the shard (1M parameters, 4 MiB) runs in its own process and its
memory is its /proc/PID/status VmRSS; floods come from raw ZMQ DEALERs in this process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from gossamer.core.errors import ShardError
from gossamer.core.protocol import PullMeta
from gossamer.paramserver import ShardClient
from gossamer.transport.frames import Message, decode, encode
from gossamer.transport.router import FAILED_PRECONDITION
from tests.integration._bounded_peer import EXPERIMENT as PEER_EXPERIMENT
from tests.integration._bounded_peer import NUMEL as PEER_NUMEL
from tests.integration._bounded_peer import serve as serve_peer
from tests.integration._bounded_shard import EXPERIMENT, NUMEL, plan, pull_forever, rss_bytes, serve

pytestmark = pytest.mark.timeout(300)
_SPAWN = mp.get_context("spawn")
_MIB = 1 << 20
#: What the shard process may grow by beyond the stated bound: the allocator's and ZMQ's own
#: bookkeeping (Python objects per request, msgpack buffers), measured at 5-15 MiB.
_SLACK = 32 * _MIB


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[tuple[mp.Process, str, Path]]:
    members = tmp_path / "members.json"
    path = tmp_path / "endpoint"
    proc = _SPAWN.Process(target=serve, args=(str(path), str(members)), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not path.exists():
            assert proc.is_alive() and time.monotonic() < deadline, "the shard did not start"
            time.sleep(0.05)
        yield proc, path.read_text(), members
    finally:
        proc.kill()
        proc.join(timeout=10)


def _wait(pred, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    deadline = t0 + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    print(f"{time.monotonic() - t0:.1f} s until not: {what}")  # where a slow run spends its time


def _pull_frames(sender: str, rid: int, pull_codec: str = "none") -> list[bytes | memoryview]:
    meta = {"rid": rid, **PullMeta(chunks=None, pull_codec=pull_codec).to_meta()}
    return encode(Message(op="PULL", experiment=EXPERIMENT, shard=0, sender=sender, meta=meta))


def _never_reading(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER that does not read: its ZMQ queue and kernel buffer hold one reply, at most a few."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


class _Worker(threading.Thread):
    """A well-behaved worker pushing and reading every reply; every acknowledged clock is kept."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.client = ShardClient(experiment=EXPERIMENT, sender="w0", plan=plan(), endpoints={0: endpoint},
                                  timeout_s=60)
        self.acked: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            grads = {0: torch.full((NUMEL,), 1e-3)}
            clock = 0
            while not self.stop.is_set():
                self.client.push_pull(grads, clock=clock, basis={0: 0})
                self.acked.append(clock)
                clock += 1
        except BaseException as e:  # noqa: BLE001
            self.error = e


def test_peers_that_never_read_cost_the_shard_a_bounded_amount_of_memory_and_a_worker_is_still_served(
    shard: tuple[mp.Process, str, Path],
) -> None:
    proc, endpoint, members = shard
    # The worker is one the coordinator named, as every worker a shard serves is: its request that finds its
    # own replies not yet released (a lag of pyzmq's, long on a loaded host) waits for them, never refused.
    members.write_text(json.dumps(["w0"]))
    worker = _Worker(endpoint)
    worker.client.hello(fresh=True)
    worker.start()
    observer = ShardClient(experiment=EXPERIMENT, sender="observer", plan=plan(), endpoints={0: endpoint})
    ctx = zmq.Context()
    try:
        _wait(lambda: len(worker.acked) >= 20 or worker.error is not None, "the worker made no progress")
        t0 = time.monotonic()
        before = observer.stats(0)
        print(f"stats before the flood: {time.monotonic() - t0:.1f} s")
        base = rss_bytes(proc.pid)
        # Every write moves the values to a new buffer while replies still hold the old one:
        # unbounded, 8 peers x 100 unread replies of 4 MiB while the worker writes kept one
        # buffer per version (3.2 GB for this flood).
        floods = [_never_reading(ctx, endpoint) for _ in range(8)]
        peak = base
        acked_during = len(worker.acked)
        for rnd in range(100):
            for i, sock in enumerate(floods):
                try:
                    sock.send_multipart(_pull_frames(f"flood{i}", rnd), zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass
            peak = max(peak, rss_bytes(proc.pid))
            time.sleep(0.01)
        _wait(lambda: len(worker.acked) >= acked_during + 20 or worker.error is not None,
              "the worker was not served during the flood")
        peak = max(peak, rss_bytes(proc.pid))
        t0 = time.monotonic()
        after = observer.stats(0)
        print(f"stats after the flood: {time.monotonic() - t0:.1f} s")
    finally:
        worker.stop.set()
        t0 = time.monotonic()
        worker.join(timeout=60)
        print(f"worker stopped: {time.monotonic() - t0:.1f} s")
        worker.client.close()
        observer.close()
        ctx.destroy(linger=0)
    assert worker.error is None, worker.error
    reply = 4 * NUMEL  # the largest reply: the shard's values
    bound = after["reply_budget_bytes"] + 2 * reply  # docs/security.md "Data-plane memory"
    growth = peak - base
    print(f"shard RSS {base / _MIB:.0f} MiB -> peak {peak / _MIB:.0f} MiB (growth {growth / _MIB:.1f} MiB, "
          f"bound {bound / _MIB:.0f} MiB + slack {_SLACK / _MIB:.0f}); refused over budget "
          f"{after['over_budget'] - before['over_budget']}, versions during the flood "
          f"{after['version'] - before['version']}")
    # The flood did exceed what the shard may hold: requests were refused, not queued.
    assert after["over_budget"] > before["over_budget"], after
    assert after["held_reply_bytes"] <= after["reply_budget_bytes"] + reply, after
    assert growth < bound + _SLACK, (growth, bound)


def test_invented_senders_keep_no_pull_view_and_a_worker_killed_without_leave_has_its_view_freed(
    shard: tuple[mp.Process, str, Path],
) -> None:
    proc, endpoint, members = shard
    members.write_text(json.dumps(["w0", "w1"]))  # the coordinator's workers
    killed = _SPAWN.Process(target=pull_forever, args=(endpoint, "w1", "int8"), daemon=True)
    killed.start()
    w0 = ShardClient(experiment=EXPERIMENT, sender="w0", plan=plan(), endpoints={0: endpoint}, pull_codec="int8")
    ctx = zmq.Context()
    try:
        w0.hello(fresh=True)
        w0.pull()
        _wait(lambda: w0.stats(0)["pull_views"] == 2, "w0 and w1 should each hold a view")
        # w1 paused while the invented senders are measured: its pulls' allocator churn in the
        # shard is not theirs (at load 17 it alone took the growth to 32.04 MiB).
        os.kill(killed.pid or 0, signal.SIGSTOP)
        base = rss_bytes(proc.pid)
        # 50 invented senders pull with int8: each would have kept a 4 MiB view (200 MiB).
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        for i in range(50):
            sock.send_multipart(_pull_frames(f"invented-{i}", i, "int8"), copy=False)
        codes = []
        for _ in range(50):
            assert sock.poll(60_000), "no answer to an invented sender's PULL"
            msg = decode(sock.recv_multipart())
            assert msg.op == "ERROR", msg.op
            codes.append(msg.meta["code"])
            assert "not a current worker" in msg.meta["error"], msg.meta["error"]
        assert set(codes) == {FAILED_PRECONDITION}
        stats = w0.stats(0)
        growth = rss_bytes(proc.pid) - base
        os.kill(killed.pid or 0, signal.SIGCONT)
        print(f"after 50 invented int8 PULLs: {stats['pull_views']} views, RSS growth {growth / _MIB:.1f} MiB")
        assert stats["pull_views"] == 2, stats["pull_views"]
        # 50 views would be 200 MiB.
        assert growth < _SLACK, growth
        with ShardClient(experiment=EXPERIMENT, sender="invented", plan=plan(), endpoints={0: endpoint},
                         pull_codec="int8") as stranger, pytest.raises(ShardError, match="not a current worker"):
            stranger.pull()
        # w1 dies without LEAVE; the coordinator's next membership leaves it out.
        os.kill(killed.pid or 0, signal.SIGKILL)
        killed.join(timeout=30)
        members.write_text(json.dumps(["w0"]))
        _wait(lambda: w0.stats(0)["pull_views"] == 1, "the killed worker's view was not freed")
        w0.pull()  # the member still pulls compressed
        assert w0.stats(0)["pull_views"] == 1
    finally:
        w0.close()
        ctx.destroy(linger=0)
        killed.kill()
        killed.join(timeout=10)


def test_gossip_peers_that_never_read_snapshots_cost_a_bounded_amount_of_memory_and_a_reader_is_then_served(
    tmp_path: Path,
) -> None:
    """The gossip peer's one large reply is a snapshot (a copy of the model); before, every
    request was answered and queued, one copy per trainer step, for peers that never read."""
    path = tmp_path / "endpoint"
    proc = _SPAWN.Process(target=serve_peer, args=(str(path),), daemon=True)
    proc.start()
    ctx = zmq.Context()
    try:
        _wait(lambda: path.exists() or not proc.is_alive(), "the gossip peer did not start", 120)
        assert proc.is_alive()
        endpoint = path.read_text()
        base = rss_bytes(proc.pid)
        floods = [_never_reading(ctx, endpoint) for _ in range(8)]
        peak = base
        for rnd in range(100):
            for sock in floods:
                snap = Message(op="SNAP", experiment=PEER_EXPERIMENT, sender="flood", meta={"rid": rnd, "light": False})
                try:
                    sock.send_multipart(encode(snap), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            peak = max(peak, rss_bytes(proc.pid))
            time.sleep(0.01)
        deadline = time.monotonic() + 2.0  # the last requests are answered at the trainer's next serve()
        while time.monotonic() < deadline:
            peak = max(peak, rss_bytes(proc.pid))
            time.sleep(0.05)
        # Now they read: each got a snapshot or a refusal (or nothing, its queue full).
        answers: dict[str, int] = {}
        for sock in floods:
            while sock.poll(300):
                msg = decode(sock.recv_multipart())
                kind = msg.op if msg.op != "ERROR" else f"ERROR {msg.meta.get('reason')}"
                answers[kind] = answers.get(kind, 0) + 1
        reader = ctx.socket(zmq.DEALER)
        reader.setsockopt(zmq.LINGER, 0)
        reader.connect(endpoint)
        served = None
        for rid in range(1000, 1100):  # the flood's replies leave as its sockets read: the budget frees
            reader.send_multipart(encode(Message(op="SNAP", experiment=PEER_EXPERIMENT, sender="reader",
                                                 meta={"rid": rid, "light": False})))
            assert reader.poll(30_000), "no answer to the reader's snapshot request"
            served = decode(reader.recv_multipart())
            if served.op == "SNAPSHOT":
                break
            time.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
        proc.kill()
        proc.join(timeout=10)
    reply = 4 * PEER_NUMEL
    bound = max(64 * _MIB, 8 * reply) + reply  # ReplyBudget's default B, plus one reply admitted under it
    growth = peak - base
    print(f"gossip peer RSS {base / _MIB:.0f} MiB -> peak {peak / _MIB:.0f} MiB (growth {growth / _MIB:.1f} MiB, "
          f"bound {bound / _MIB:.0f} MiB + slack {_SLACK / _MIB:.0f}); answers {answers}")
    assert answers.get("ERROR reply_budget", 0) > 0, answers  # the flood did exceed the budget
    assert growth < bound + _SLACK, (growth, bound)
    assert served is not None and served.op == "SNAPSHOT", served
