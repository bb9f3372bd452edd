"""Primary/backup shard replication over real ZMQ: bit-identical state, SYNC of a late backup, detach on silence."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from gossamer.paramserver import ShardClient, ShardPlan, ShardServer
from tests.chaos._shard_proc import model, shard_config


def _server(backup: bool, **kw: object) -> ShardServer:
    m = model()
    plan = ShardPlan.for_module(m, 1, chunk_numel=200)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks}
    cfg = shard_config()
    if kw:
        from dataclasses import replace

        cfg = replace(cfg, **kw)  # type: ignore[arg-type]
    s = ShardServer(cfg, plan, init, backup=backup)
    s.start()
    return s


def _push(client: ShardClient, n: int, start: int = 0) -> None:
    g = torch.Generator().manual_seed(start)
    for clock in range(start, start + n):
        grads = {c.index: torch.randn(c.numel, generator=g) for c in client.plan.chunks}
        client.push_pull(grads, clock=clock, basis={0: 0})


def _optimizer_state(s: ShardServer) -> list[torch.Tensor]:
    return [v for st in s.state_dict()["optimizer"]["state"].values() for v in st.values()
            if isinstance(v, torch.Tensor)]


def _wait(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_backup_holds_bit_identical_state_and_a_late_backup_is_synced() -> None:
    primary, backup, late = _server(False), _server(True), _server(True)
    client = ShardClient(experiment="chaos", sender="w", plan=primary.plan, endpoints={0: primary.endpoint})
    try:
        primary.post(lambda: primary.set_backup(backup.endpoint))
        _push(client, 40)
        assert primary.replicated and backup.version == primary.version == 40
        for a, b in zip(primary.values().values(), backup.values().values(), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(_optimizer_state(primary), _optimizer_state(backup), strict=True):
            assert torch.equal(a, b)  # momentum buffers too: the backup can take over exactly
        # A replacement backup gets the whole state first (SYNC), then every update.
        primary.post(lambda: primary.set_backup(late.endpoint))
        _push(client, 10, start=40)
        _wait(lambda: late.version == 50)
        for a, b in zip(primary.values().values(), late.values().values(), strict=True):
            assert torch.equal(a, b)
        assert late.stats()["applied"] == {"w": 49}
    finally:
        client.close()
        for s in (primary, backup, late):
            s.close()


def test_silent_backup_is_detached_and_counted_not_waited_on_forever() -> None:
    primary, backup = _server(False, backup_timeout_s=0.5), _server(True)
    client = ShardClient(experiment="chaos", sender="w", plan=primary.plan, endpoints={0: primary.endpoint},
                         timeout_s=20)
    try:
        primary.post(lambda: primary.set_backup(backup.endpoint))
        _push(client, 5)
        _wait(lambda: primary.replicated)  # attached (a posted command) and synced: it may come after the pushes
        backup.close()  # gone without a word
        t0 = time.monotonic()
        _push(client, 5, start=5)
        assert time.monotonic() - t0 < 5.0
        st = primary.stats()
        assert not st["replicated"] and st["backup_detaches"] == 1 and st["unreplicated"] >= 1
        assert st["version"] == 10
    finally:
        client.close()
        primary.close()


def test_a_backup_that_answered_while_the_primary_was_busy_is_not_taken_for_silent() -> None:
    """Two pushes read in one batch; the second's step outlasts `backup_timeout_s` while the backup acknowledges
    the first: the primary reads that ACK before judging the backup silent (it was detached before)."""
    primary, backup = _server(False, backup_timeout_s=0.5), _server(True)
    clients = [ShardClient(experiment="chaos", sender=f"w{i}", plan=primary.plan, endpoints={0: primary.endpoint},
                           timeout_s=20) for i in range(2)]
    state = primary._state  # noqa: SLF001 — a step made slow, as a large shard's or one waiting for a checkpoint
    step = state.step
    slow = threading.Event()
    released = threading.Event()

    steps_since = [0]

    def slow_step(*args: Any, **kw: Any) -> float:
        out = step(*args, **kw)
        if slow.is_set():
            steps_since[0] += 1
            if steps_since[0] == 2:  # the second push of the batch: the backup acknowledges the first meanwhile
                deadline = time.monotonic() + 10
                while backup.version < state.version - 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.6)  # the step outlasts backup_timeout_s, the first push's ACK unread
        return out

    state.step = slow_step  # type: ignore[method-assign]
    try:
        primary.post(lambda: primary.set_backup(backup.endpoint))
        _push(clients[0], 2)
        _wait(lambda: primary.replicated)
        before = primary.stats()  # pushes answered while the SYNC was on its way count as unreplicated
        primary.post(lambda: released.wait(10))  # the serve thread busy while both pushes arrive
        g = {c.index: torch.ones(c.numel) for c in primary.plan.chunks}
        for i, c in enumerate(clients):
            c.push_async(g, clock=10 + i, basis={0: 0})
        slow.set()
        released.set()
        for c in clients:
            c.wait()
        st = primary.stats()
        assert st["backup_detaches"] == before["backup_detaches"] == 0, st["backup_detaches"]
        assert st["replicated"] and st["unreplicated"] == before["unreplicated"], (st["unreplicated"], before)
        _wait(lambda: backup.version == primary.version == 4)
    finally:
        for c in clients:
            c.close()
        primary.close()
        backup.close()
