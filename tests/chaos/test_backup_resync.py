"""A backup stopped past the stall timeout is detached, re-synced once it runs again, and then takes over losing nothing acknowledged."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from gossamer.paramserver import ShardClient, ShardPlan
from tests.chaos._shard_proc import model, promote, shard_config, start_shard

pytestmark = pytest.mark.timeout(300)


def _wait(pred, what: str, timeout: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class _Pusher(threading.Thread):
    """A worker pushing until stopped; every acknowledged clock is kept. It follows `moved["to"]`."""

    def __init__(self, name: str, plan: ShardPlan, endpoint: str, moved: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.client = ShardClient(experiment="chaos", sender=name, plan=plan, endpoints={0: endpoint}, timeout_s=30)
        self.client.on_wait = lambda: self.client.set_endpoints({0: moved["to"]}) if "to" in moved else None
        self.acked: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        gen = torch.Generator().manual_seed(len(self.client.sender))
        try:
            self.client.hello(fresh=True)
            clock = 0
            while not self.stop.is_set():
                grads = {c.index: torch.randn(c.numel, generator=gen) * 0.01 for c in self.client.plan.chunks}
                self.client.push_pull(grads, clock=clock, basis={0: 0})
                self.acked.append(clock)
                clock += 1
                time.sleep(0.005)
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.client.close()


def test_backup_stopped_past_the_stall_timeout_is_resynced_and_then_takes_over_losing_nothing(tmp_path: Path) -> None:
    plan = ShardPlan.for_module(model(), 1, chunk_numel=200)
    stall_s = shard_config().backup_timeout_s
    backup, backup_ep = start_shard(tmp_path, "backup", backup=True)
    primary, primary_ep = start_shard(tmp_path, "primary", backup=False, backup_endpoint=backup_ep)
    observer = ShardClient(experiment="chaos", sender="observer", plan=plan, endpoints={0: primary_ep}, timeout_s=30)
    moved: dict[str, str] = {}
    pushers = [_Pusher(f"w{i}", plan, primary_ep, moved) for i in range(2)]
    try:
        _wait(lambda: observer.stats(0)["replicated"], "the backup never synced")
        for p in pushers:
            p.start()
        _wait(lambda: sum(len(p.acked) for p in pushers) >= 50, "no progress")
        os.kill(backup.pid or 0, signal.SIGSTOP)
        stopped = time.monotonic()
        _wait(lambda: observer.stats(0)["backup_detaches"] >= 1, "the stopped backup was not detached")
        detached_after = time.monotonic() - stopped
        acked_at_stop = sum(len(p.acked) for p in pushers)
        _wait(lambda: sum(len(p.acked) for p in pushers) >= acked_at_stop + 30, "the primary stopped serving")
        assert not observer.stats(0)["replicated"]
        time.sleep(max(0.0, stall_s + 2 - (time.monotonic() - stopped)))  # stopped well past the stall timeout
        os.kill(backup.pid or 0, signal.SIGCONT)
        continued = time.monotonic()
        _wait(lambda: observer.stats(0)["replicated"], "the backup was never re-synced")
        resynced_after = time.monotonic() - continued
        stats = observer.stats(0)
        assert stats["resyncs"] >= 1 and stats["backup_detaches"] >= 1, stats
        print(f"backup stopped: detached after {detached_after:.1f}s (stall timeout {stall_s}s); re-synced "
              f"{resynced_after:.1f}s after SIGCONT ({stats['resyncs']} re-attach attempts, "
              f"{stats['unreplicated']} updates acknowledged unreplicated meanwhile)")
        # Replicated again: acknowledged updates are on the backup from here on.
        acked_synced = sum(len(p.acked) for p in pushers)
        _wait(lambda: sum(len(p.acked) for p in pushers) >= acked_synced + 30, "no progress after the re-sync")
        os.kill(primary.pid or 0, signal.SIGKILL)
        primary.join(timeout=30)
        acked_at_kill = {p.client.sender: (p.acked[-1] if p.acked else -1) for p in pushers}
        # What the coordinator's promotion does: the backup is promoted at epoch 1 (only its word
        # promotes) and the workers follow.
        promote(tmp_path, "backup", epoch=1)
        moved["to"] = backup_ep
        total = sum(len(p.acked) for p in pushers)
        _wait(lambda: sum(len(p.acked) for p in pushers) >= total + 30 or any(p.error for p in pushers),
              "the backup did not take over")
    finally:
        for p in pushers:
            p.stop.set()
        for p in pushers:
            p.join(timeout=30)
        observer.close()
        primary.kill()
    assert not any(p.error for p in pushers), [p.error for p in pushers]
    survivor = ShardClient(experiment="chaos", sender="observer", plan=plan, endpoints={0: backup_ep}, timeout_s=30)
    try:
        after = survivor.stats(0)
    finally:
        survivor.close()
        backup.kill()
        backup.join(timeout=10)
    assert after["primary"] and after["promotions"] == 1, after
    for p in pushers:
        assert p.acked == list(range(len(p.acked)))  # every push was acknowledged, in order
        # Every update acknowledged before the kill, including those acknowledged while the
        # backup was stopped (unreplicated then, carried by the re-sync), is on the survivor.
        assert after["applied"][p.client.sender] >= acked_at_kill[p.client.sender], (after["applied"], acked_at_kill)
