"""A shard in its own process for the checkpoint-memory test: its peak resident set while a checkpoint is written beside updates."""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path

import torch

NUMEL = 16 << 20  # 64 MiB of fp32 values in 16 chunks of 1M: a copy of the shard is plain in the RSS


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/self/status")


def checkpoint_beside_updates(conn: Connection, root: str, updates: int) -> None:
    """Build shard 0 (SGD momentum), step once, then open a checkpoint at that version and apply `updates`
    updates while it is written (at least that many, and until it is written). Sends (peak RSS growth over
    the state in bytes, checkpoints saved, updates applied meanwhile)."""
    torch.set_num_threads(1)
    from gossamer.checkpoint.sharded import AsyncCheckpointer
    from gossamer.engine.allocator import mmap_large_allocations
    from gossamer.paramserver import OptimizerConfig, ShardConfig, ShardPlan, ShardServer

    mmap_large_allocations()  # as a role process does: freed buffers go back to the OS, not to glibc's heaps
    plan = ShardPlan.build([("w", NUMEL)], 1)
    config = ShardConfig(experiment="ckmem", shard=0, mode="async", staleness=None, total_steps=10**6,
                         optimizer=OptimizerConfig(name="sgd", lr=0.01, momentum=0.9))
    server = ShardServer(config, plan, {c.index: torch.zeros(c.numel) for c in plan.chunks}, own_init=True)
    state, lock = server._state, server._lock  # noqa: SLF001 — the serve thread's part, without sockets
    grads = {c.index: torch.full((c.numel,), 1e-3) for c in plan.chunks}  # one gradient, reused: not counted
    with lock:
        state.step(grads, 1.0, schedule=False)  # the momentum buffers exist: the state is 2x the values
    ck = AsyncCheckpointer(root)
    Path("/proc/self/clear_refs").write_text("5")
    rss = _status_kb("VmRSS") * 1024
    with lock:
        server.snapshot_later(state.version, ck.submit)
    applied = 0
    while applied < updates or ck.busy or ck.saved == 0:
        with lock:
            state.step(grads, 1.0, schedule=False)
        applied += 1
        if applied > 1000:
            break
    ck.wait(120)
    conn.send((_status_kb("VmHWM") * 1024 - rss, ck.saved, applied))
    server.close()
