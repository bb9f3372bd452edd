"""Shard servers checkpoint through DCP and restore onto a different number of shards, optimizer state included."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gossamer.checkpoint.sharded import latest_good, save_shard
from gossamer.paramserver import (
    OptimizerConfig,
    ShardConfig,
    ShardPlan,
    ShardServer,
    flatten_params,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))


def _servers(num_shards: int) -> list[ShardServer]:
    m = _model()
    plan = ShardPlan.for_module(m, num_shards, chunk_numel=64)
    flat = flatten_params(m)
    out = []
    for s in range(num_shards):
        cfg = ShardConfig(experiment="x", shard=s, mode="async", staleness=None, total_steps=10**6,
                          optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
        init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks_of_shard(s)}
        out.append(ShardServer(cfg, plan, init, shapes={n: tuple(p.shape) for n, p in m.named_parameters()}))
    return out


def _flat(servers: list[ShardServer], key: str) -> torch.Tensor:
    plan = servers[0].plan
    out = torch.zeros(plan.total_numel)
    for s in servers:
        snap = s.snapshot(0)
        for offset, piece in snap.pieces.items():
            out[offset : offset + piece[key].numel()] = piece[key]
    return out


def test_checkpoint_of_two_shards_restores_onto_one_and_three(tmp_path: Path) -> None:
    saved = _servers(2)
    g = torch.Generator().manual_seed(1)
    for s in saved:  # a few real optimizer steps, so momentum buffers exist
        for _ in range(3):
            with s._lock:
                s._apply({c.index: torch.randn(c.numel, generator=g) for c in s.plan.chunks_of_shard(s.config.shard)},
                         1.0, [("w", s.version)])
    for s in saved:
        save_shard(tmp_path, s.snapshot(3))
    step, refused = latest_good(tmp_path)
    assert step is not None and not refused
    want_p, want_m = _flat(saved, "param"), _flat(saved, "momentum_buffer")
    for k in (1, 3):
        restored = _servers(k)
        for s in restored:
            assert s.restore(str(step)) == 3
        assert torch.equal(_flat(restored, "param"), want_p)
        assert torch.equal(_flat(restored, "momentum_buffer"), want_m)
        assert all(s.stats()["applied"] == {"w": 2} for s in restored)


def test_restore_posted_to_a_serving_shard_does_not_deadlock(tmp_path: Path) -> None:
    from gossamer.paramserver import ShardClient

    (saved,) = _servers(1)
    with saved._lock:
        saved._apply({c.index: torch.ones(c.numel) for c in saved.plan.chunks}, 1.0, [("w", 0)])
    save_shard(tmp_path, saved.snapshot(1))
    step, _ = latest_good(tmp_path)
    (live,) = _servers(1)
    live.start()
    client = ShardClient(experiment="x", sender="obs", plan=live.plan, endpoints={0: live.endpoint}, timeout_s=5)
    try:
        live.post(lambda: live.restore(str(step)))  # as the role process does on an assignment update
        deadline = time.monotonic() + 5
        while client.stats(0)["version"] != 1:  # the serve thread stays alive and restores
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert torch.equal(torch.cat(list(live.values().values())), torch.cat(list(saved.values().values())))
    finally:
        client.close()
        live.close()
