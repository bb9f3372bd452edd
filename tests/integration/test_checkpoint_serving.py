"""A shard whose live values are still being read keeps serving: a push that would wait for a checkpoint's
writer is kept back while pulls and STATS are answered, and applied once the writer has written enough; a push
kept back for a reply that is never read goes on after a second, writing aside (a real shard, real ZMQ)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import zmq

from gossamer.checkpoint.sharded import ShardSnapshot
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.transport.frames import Message, encode

pytestmark = pytest.mark.timeout(120)
NUMEL = 4 << 20  # 16 MiB of values and 16 MiB of momentum: more than the 16 MiB an update may write aside


def _wait_for(what: str, cond: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_push_is_kept_back_for_a_behind_writer_while_pulls_are_served() -> None:
    plan = ShardPlan.build([("w", NUMEL)], 1)
    config = ShardConfig(experiment="ckserve", shard=0, mode="async", staleness=None,
                         optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), total_steps=10**6)
    server = ShardServer(config, plan, {c.index: torch.zeros(c.numel) for c in plan.chunks}, shapes={"w": (NUMEL,)})
    server.start()
    clients = [ShardClient(experiment="ckserve", sender=f"w{i}", plan=plan, endpoints={0: server.endpoint},
                           timeout_s=60) for i in range(2)]
    worker: threading.Thread | None = None
    try:
        grads = {c.index: torch.ones(c.numel) for c in plan.chunks}
        assert clients[0].push_pull(grads, clock=0, basis={0: 0}).versions == {0: 1}  # the momentum exists now
        got: list[ShardSnapshot] = []
        with server._lock:  # noqa: SLF001 — snapshot_later runs on the serve thread, under the lock
            pending = server.snapshot_later(1, got.append)  # the test is the writer, and it is slow

        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(r=clients[0].push_pull(grads, clock=1, basis={0: 1})))
        worker.start()
        _wait_for("the push to be kept back", lambda: server.stats()["push_deferrals"] == 1)
        # Everything else is served meanwhile: a pull of the values the snapshot holds, and STATS.
        before = clients[1].pull()
        assert before.versions == {0: 1} and worker.is_alive() and server.version == 1
        assert clients[1].stats(0)["version"] == 1

        written: dict[int, torch.Tensor] = {}
        for offset, entry in got[0].pieces.items():  # the writer's order
            for name in entry:
                t = pending.take(offset, name)
                if name == "param":
                    written[offset] = t.clone()
                pending.written(offset, name)
        worker.join(timeout=60)
        assert not worker.is_alive() and result["r"].versions == {0: 2}
        assert pending.wait_seconds == 0 and pending.waits == 0  # the serve thread never waited for the writer
        assert server.stats()["push_deferrals"] == 1
        # The snapshot holds version 1, whatever the kept-back push did after.
        for c in plan.chunks:
            assert torch.equal(written[c.flat_offset], before.values[c.index]), c.index
    finally:
        if worker is not None:
            worker.join(timeout=60)
        for cl in clients:
            cl.close()
        server.close()


def test_a_push_kept_back_for_a_reply_nobody_reads_goes_on_after_a_second() -> None:
    """A stranger-ish peer asks for the values (64 MiB) and never reads them: its reply holds the live values,
    so the next push is kept back (not written beside the reply at once), but only for `LENT_HOLD_S`; then it
    is applied out of place and answered, and the run goes on."""
    numel = 16 << 20
    plan = ShardPlan.build([("w", numel)], 1)
    config = ShardConfig(experiment="lent", shard=0, mode="async", staleness=None,
                         optimizer=OptimizerConfig(name="sgd", lr=0.1), total_steps=10**6)
    server = ShardServer(config, plan, {c.index: torch.zeros(c.numel) for c in plan.chunks}, shapes={"w": (numel,)})
    server.start()
    ctx = zmq.Context()
    sink = ctx.socket(zmq.DEALER)
    sink.setsockopt(zmq.LINGER, 0)
    sink.setsockopt(zmq.RCVBUF, 4096)
    sink.setsockopt(zmq.RCVHWM, 1)
    try:
        sink.connect(server.endpoint)
        for rid in range(2):  # two replies queued: more than libzmq and the kernel take off the shard at once
            sink.send_multipart(encode(Message(op="PULL", experiment="lent", shard=0, sender="sink", meta={"rid": rid})))
        _wait_for("the shard to have sent the values", lambda: server.stats()["bytes_out"] > 4 * numel)
        with ShardClient(experiment="lent", sender="w1", plan=plan, endpoints={0: server.endpoint},
                         timeout_s=60) as client:
            res = client.push_pull({c.index: torch.ones(c.numel) for c in plan.chunks}, clock=0, basis={0: 0})
        assert res.versions == {0: 1}
        stats = server.stats()
        assert stats["push_deferrals"] == 1 and stats["cow_copies"] == 1, stats
    finally:
        sink.close()
        ctx.term()
        server.close()
