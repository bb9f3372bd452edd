"""kill -9 of a primary shard (also exactly between apply and reply): the backup has every acknowledged update."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from gossamer.paramserver import ShardClient, ShardPlan
from tests.chaos._shard_proc import model, promote, start_shard

pytestmark = pytest.mark.timeout(180)


class _Pusher(threading.Thread):
    """A worker pushing random gradients; records every acknowledged clock."""

    def __init__(self, name: str, plan: ShardPlan, endpoint: str, moved: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.client = ShardClient(experiment="chaos", sender=name, plan=plan, endpoints={0: endpoint}, timeout_s=30)
        self.moved = moved
        self.client.on_wait = self._follow
        self.acked: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.gen = torch.Generator().manual_seed(hash(name) % 1000)

    def _follow(self) -> None:
        if "to" in self.moved:
            self.client.set_endpoints({0: self.moved["to"]})

    def run(self) -> None:
        try:
            self.client.hello(fresh=True)
            clock = 0
            while not self.stop.is_set():
                grads = {c.index: torch.randn(c.numel, generator=self.gen) * 0.01 for c in self.client.plan.chunks}
                self.client.push_pull(grads, clock=clock, basis={0: 0})
                self.acked.append(clock)  # the shard acknowledged this update
                clock += 1
                time.sleep(0.002)
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.client.close()


@pytest.mark.parametrize("fault", ["", "die:at=after-apply:step=300"], ids=["kill-anywhere", "kill-between-apply-and-reply"])
def test_primary_kill9_loses_no_acknowledged_update(tmp_path: Path, fault: str) -> None:
    plan = ShardPlan.for_module(model(), 1, chunk_numel=200)
    backup, backup_ep = start_shard(tmp_path, "backup", backup=True)
    primary, primary_ep = start_shard(tmp_path, "primary", backup=False, backup_endpoint=backup_ep, fault=fault)
    moved: dict[str, str] = {}
    pushers = [_Pusher(f"w{i}", plan, primary_ep, moved) for i in range(3)]
    try:
        for p in pushers:
            p.start()
        deadline = time.monotonic() + 60
        while sum(len(p.acked) for p in pushers) < 250 and primary.is_alive():
            assert time.monotonic() < deadline and not any(p.error for p in pushers)
            time.sleep(0.01)
        if not fault:
            os.kill(primary.pid or 0, signal.SIGKILL)  # anywhere: mid-push, mid-apply, mid-reply
        primary.join(timeout=30)
        assert primary.exitcode == -signal.SIGKILL
        acked_at_kill = sum(len(p.acked) for p in pushers)
        # What the coordinator's promotion does: the backup is promoted at epoch 1 and the workers
        # follow at once; until the backup has taken it, it refuses them NOT_PRIMARY and they ask again.
        promote(tmp_path, "backup", epoch=1)
        moved["to"] = backup_ep
        deadline = time.monotonic() + 60
        while sum(len(p.acked) for p in pushers) < acked_at_kill + 150:
            assert time.monotonic() < deadline and not any(p.error for p in pushers), [p.error for p in pushers]
            time.sleep(0.01)
    finally:
        for p in pushers:
            p.stop.set()
        for p in pushers:
            p.join(timeout=30)
    assert not any(p.error for p in pushers), [p.error for p in pushers]
    observer = ShardClient(experiment="chaos", sender="observer", plan=plan, endpoints={0: backup_ep}, timeout_s=10)
    try:
        stats = observer.stats(0)
    finally:
        observer.close()
        backup.kill()
    backup.join(timeout=10)
    applied = stats["applied"]
    for p in pushers:
        # Every clock a worker saw acknowledged is applied on the survivor, exactly once.
        assert p.acked == list(range(len(p.acked)))
        assert applied[p.client.sender] >= p.acked[-1], (p.client.sender, applied, p.acked[-1])
    total_acked = sum(len(p.acked) for p in pushers)
    # Acknowledged => applied; at most the one in-flight push per worker was applied unacknowledged
    # (and then re-sent: recognised as a duplicate, not applied twice).
    assert total_acked <= stats["version"] <= total_acked + len(pushers), (stats["version"], total_acked)
    assert stats["primary"] and stats["promotions"] == 1
    # A push applied by the primary but not acknowledged is either on the backup (the re-send
    # is a duplicate) or not (the re-send is applied there): never twice, never lost.
    assert stats["discarded"].get("duplicate", 0) <= len(pushers)
