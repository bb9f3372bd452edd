"""Bytes a primary shard sends its backup per update: compressed pushes forwarded encoded vs the dense fp32 gradient.

Run: ``python -m bench.replication [--quick]``. Writes bench/results/replication.{json,md}.

A primary and a backup shard (in process, real ZMQ on loopback) of a 2-layer MLP; workers
push with each codec. Every case runs twice in the same run: with ``replicate_encoded``
(the pushes forwarded as they arrived; the backup decodes them) and without (the dense fp32
gradient the primary applied). Bytes are counted by the primary's
replication counter (every frame of each REPLICATE, header included) after the backup's
SYNC, and checked against the backup's received bytes; they do not depend on load. The
backup's state is compared with the primary's after each case (bit-identical).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bench._report import write_report
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.paramserver import (
    OptimizerConfig,
    ShardClient,
    ShardConfig,
    ShardPlan,
    ShardServer,
)


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


def _wait(pred: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def measure(width: int, codec: str | None, workers: int, updates: int, *, encoded: bool) -> dict[str, Any]:
    """Replication bytes per update for `workers` pushing with `codec` (None: uncompressed pushes)."""
    m = _model(width)
    plan = ShardPlan.for_module(m, 1, chunk_numel=1 << 18)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks}
    mode = "sync" if workers > 1 else "async"
    cfg = ShardConfig(experiment="bench", shard=0, mode=mode, staleness=None,
                      optimizer=OptimizerConfig(name="sgd", lr=0.01, momentum=0.9), total_steps=10**6,
                      backup_timeout_s=120.0, replicate_encoded=encoded)
    primary, backup = (ShardServer(cfg, plan, init, shapes=shapes, backup=b) for b in (False, True))
    clients: list[ShardClient] = []
    try:
        for s in (primary, backup):
            s.start()
        primary.post(lambda: primary.set_backup(backup.endpoint))
        _wait(lambda: primary.replicated, "the backup's SYNC")
        clients = [ShardClient(experiment="bench", sender=f"w{i}", plan=plan, endpoints={0: primary.endpoint},
                               compressor=None if codec is None else ChunkCompressor(codec, plan, shapes=shapes),
                               timeout_s=120) for i in range(workers)]
        p0, b0 = primary.stats(), backup.stats()
        pd0, bd0 = primary.decode_seconds, backup.decode_seconds
        g = torch.Generator().manual_seed(1)
        with ThreadPoolExecutor(workers) as pool:
            for step in range(updates):
                futures = [pool.submit(c.push_pull, {ch.index: torch.randn(ch.numel, generator=g) for ch in plan.chunks},
                                       clock=step, basis={0: step}, step=step if mode == "sync" else None,
                                       num_workers=workers if mode == "sync" else None) for c in clients]
                for f in futures:
                    f.result(timeout=300)
        p1, b1 = primary.stats(), backup.stats()
        sent = p1["replicate_bytes"] - p0["replicate_bytes"]
        received = b1["bytes_in"] - b0["bytes_in"]
        if sent != received or p1["replicated_updates"] - p0["replicated_updates"] != updates:
            raise AssertionError(f"sent {sent} B, the backup received {received} B: {p1}")
        same = all(torch.equal(a, b) for a, b in zip(primary.values().values(), backup.values().values(), strict=True))
        if not same:
            raise AssertionError(f"{codec}: the backup's values differ from the primary's")
        return {"bytes_per_update": sent // updates,
                "primary_decode_ms": 1e3 * (primary.decode_seconds - pd0) / updates,
                "backup_decode_ms": 1e3 * (backup.decode_seconds - bd0) / updates,
                "pushed_per_update": (p1["bytes_in"] - p0["bytes_in"]) // updates,
                "encoded_updates": p1["replicated_encoded"] - p0["replicated_encoded"],
                "numel": plan.total_numel}
    finally:
        for c in clients:
            c.close()
        for s in (primary, backup):
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer updates")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()
    width, updates = (256, 2) if args.quick else (1024, 3)
    cases: list[tuple[str | None, int]] = [(None, 1), ("fp16", 1), ("int8", 1), ("topk:0.01", 1), ("powersgd:4", 1),
                                           ("fp16", 4), ("int8", 4), ("topk:0.01", 4), ("powersgd:4", 4)]
    load0 = os.getloadavg()[0]
    rows = []
    for codec, workers in cases:
        dense = measure(width, codec, workers, updates, encoded=False)
        enc = measure(width, codec, workers, updates, encoded=True)
        rows.append({
            "codec": codec or "none", "mode": "async, 1 worker" if workers == 1 else f"sync, {workers} workers",
            "fp32 gradient B/update (before)": dense["bytes_per_update"],
            "forwarded B/update (after)": enc["bytes_per_update"],
            "pushed B/update (workers -> primary)": enc["pushed_per_update"],
            "after/before": round(enc["bytes_per_update"] / dense["bytes_per_update"], 4),
            "before/after": round(dense["bytes_per_update"] / enc["bytes_per_update"], 2),
            "updates forwarded encoded": f"{enc['encoded_updates']}/{updates}",
            "decode ms/update primary, backup (after)":
                f"{enc['primary_decode_ms']:.1f}, {enc['backup_decode_ms']:.1f}",
        })
        print(rows[-1], flush=True)
    params = sum(p.numel() for p in _model(width).parameters())
    notes = (f"Primary -> backup bytes per applied update (every frame of a REPLICATE, header included), "
             f"{params:,} fp32 parameters (a {width}x{width} 2-layer MLP, chunks of 2^18 values), one shard, "
             f"server SGD with momentum; {updates} updates per case after the backup's SYNC. 'before': the dense "
             "fp32 gradient (replicate_encoded=False); 'after': the compressed "
             "pushes forwarded as they arrived, or the dense gradient where that is the smaller message (sync "
             "steps whose pushes add up to more than the fp32 sum, uncompressed pushes); 'pushed': every frame the "
             "workers' PUSHes brought the primary per update (all workers together). Backup checked "
             "bit-identical to the primary after every case. 'decode ms': wall time the codecs took per update "
             "(perf_counter, shared 2-core machine: depends on load); with the encoded form the backup decodes "
             "the pushes as the primary does, where before it decoded nothing. Bytes do not depend on load "
             f"(load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end).")
    write_report("replication", rows, notes, None if args.out is None else pathlib.Path(args.out))


if __name__ == "__main__":
    main()
