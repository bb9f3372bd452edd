"""Replication's window against none (every REPLICATE sent at once, as before it): async updates/s and what each
replica's peak grows over its state, alternated round by round in one run.

    python -m bench.replication_window [--rounds 3] [--updates 6] [--label LABEL]

A primary and its backup (shard 0 of `bench/_replicated_pair.py`: 64 MiB of fp32 values, SGD
Nesterov momentum) each in its own process, real ZMQ on loopback; two ShardClients here push dense gradients
at once, async, `--updates` each per block, and wait for each reply (acknowledged once the backup holds the
update). Blocks alternate between the default window (`REPLICATE_WINDOW_BYTES`: these dense 64 MiB updates go
one at a time) and an unbounded one (the machine's load hits both alike). Per block: updates/s over the block,
the REPLICATEs that waited for an ACK, and each replica's peak RSS growth over the block, in shards of values.
Writes bench/results/replication_window.{json,md} (a --label run: bench/out/replication_window_<label>.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench._replicated_pair import EXPERIMENT, NUMEL, plan, replica
from bench._report import write_report
from gossamer.paramserver import ShardClient
from gossamer.paramserver._replication import REPLICATE_WINDOW_BYTES

UNBOUNDED = 1 << 62


def _ask(conn: Connection, request: object) -> Any:
    conn.send(request)
    assert conn.poll(300), f"no answer to {request!r}"
    return conn.recv()


def _block(endpoint: str, primary: Connection, backup: Connection, window: int, first_clock: int,
           updates: int) -> dict[str, Any]:
    p = plan()
    _ask(primary, ("window", window))
    waits0 = _ask(primary, "stats")["replicate_window_waits"]
    version0 = _ask(primary, "peak")[1]
    workers = [ShardClient(experiment=EXPERIMENT, sender=f"w{i}", plan=p, endpoints={0: endpoint}, timeout_s=300)
               for i in range(2)]
    grads = [{c.index: torch.randn(c.numel, generator=torch.Generator().manual_seed(k)) * 1e-3 for c in p.chunks}
             for k in range(2)]
    rss = {"primary": _ask(primary, "reset"), "backup": _ask(backup, "reset")}

    def train(k: int) -> None:
        for clock in range(first_clock, first_clock + updates):
            workers[k].push_pull(grads[k], clock=clock, basis={0: 0})

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(train, k) for k in range(2)]:
                f.result(timeout=600)
    finally:
        for w in workers:
            w.close()
    seconds = time.perf_counter() - t0
    peaks = {"primary": _ask(primary, "peak"), "backup": _ask(backup, "peak")}
    shard = 4 * NUMEL
    applied = peaks["primary"][1] - version0
    return {"window_mb": round(window / (1 << 20)) if window != UNBOUNDED else "none", "updates": applied,
            "seconds": seconds, "updates_per_s": applied / seconds,
            "waited": _ask(primary, "stats")["replicate_window_waits"] - waits0,
            "primary_grown_x": (peaks["primary"][0] - rss["primary"]) / shard,
            "backup_grown_x": (peaks["backup"][0] - rss["backup"]) / shard}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default=None, help="a labelled run: written to bench/out/")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=6, help="updates per worker per block")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=replica, args=(child, backup, "async"), daemon=True)
             for (_, child), backup in zip(pipes, (False, True), strict=True)]
    for proc in procs:
        proc.start()
    primary, backup = pipes[0][0], pipes[1][0]
    rows: list[dict[str, Any]] = []
    try:
        endpoint = primary.recv()
        _ask(primary, ("attach", backup.recv()))
        clock = 0
        # A first block each way, not counted: the momentum buffers and ZMQ's buffers exist before the measures.
        for window in (REPLICATE_WINDOW_BYTES, UNBOUNDED):
            _block(endpoint, primary, backup, window, clock, 1)
            clock += 1
        for r in range(args.rounds):
            for window in (REPLICATE_WINDOW_BYTES, UNBOUNDED) if r % 2 == 0 else (UNBOUNDED, REPLICATE_WINDOW_BYTES):
                row = {"label": args.label or "current", "round": r, **_block(endpoint, primary, backup, window, clock,
                                                                 args.updates)}
                clock += args.updates
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for conn in (primary, backup):
            conn.send("stop")
        for proc in procs:
            proc.join(timeout=30)
    for window in {str(r["window_mb"]) for r in rows}:
        mine = [r for r in rows if str(r["window_mb"]) == window]
        rows.append({"label": args.label or "current", "round": "median", "window_mb": mine[0]["window_mb"],
                     **{k: statistics.median(r[k] for r in mine) for k in ("updates", "seconds", "updates_per_s",
                                                                            "waited", "primary_grown_x",
                                                                            "backup_grown_x")}})
    notes = ("A primary and its backup, each in its own process (64 MiB of fp32 values, SGD Nesterov momentum), "
             "two ShardClients pushing dense gradients at once, async; blocks alternate between the REPLICATE "
             "window (64 MiB: these updates go one at a time) and none (every REPLICATE sent at once). "
             "`updates_per_s`: over the block; `waited`: REPLICATEs that waited for an ACK; `*_grown_x`: the "
             "replica's peak RSS growth over the block, in shards of values (its state is 2x). Timings on a "
             "2-core machine shared with other jobs: compare within a run, the rows' medians.")
    js, md = write_report("replication_window", rows, notes, label=args.label)
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
