"""Primary/backup shard replication over real ZMQ: bit-identical state, SYNC of a late backup, detach on silence."""

from __future__ import annotations

import time

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
