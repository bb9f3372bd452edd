"""Serving while a 100M-parameter shard checkpoints: the serve thread's time per checkpoint, and push latency.

    python -m bench.checkpoint_stall [--label LABEL] [--numel 100000000] [--every 4]

A real ShardServer in its own process (as a role process: glibc's large allocations by mmap,
`mmap_large_allocations`) holds one shard of `--numel` fp32 values with SGD momentum 0.9 (the
state is twice the values) and checkpoints every `--every` versions through the real
`AsyncCheckpointer` into a temporary directory (as `server_role` does: `snapshot_later`,
skipped while the previous save runs). `--workers` real ShardClients here (threads) push full
gradients and read the PARAMS reply, each one push at a time, in blocks of pushes that
alternate between checkpoints off and on (the machine's load hits both alike).

The server times every optimizer step (`ShardState.step`, wrapped here) in the serve thread's
CPU time (wall time on a machine shared with other jobs mostly measures their load) and says
whether a snapshot was pending (opened, not yet delivered to the writer, or not yet written where
the writer streams it from the live state) when it ran. The serve thread's
time attributable to a checkpoint: opening it, plus what the steps that ran while one was
pending took over the median step of the blocks without checkpoints. Latency: each push+reply,
in the blocks without checkpoints, in the blocks with them, and the pushes in flight while a
step ran with a snapshot pending. Writes bench/results/checkpoint_stall.{json,md} (a --label run:
bench/out/checkpoint_stall_<label>.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench._report import write_report
from gossamer.checkpoint.sharded import AsyncCheckpointer
from gossamer.engine.allocator import mmap_large_allocations
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer

MB = 1e6
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def _server(q: Any, stop: Any, ckpt_on: Any, numel: int, every: int, root: str) -> None:
    """The shard's process: serve, checkpoint when `ckpt_on` is set, report its timings on `q`."""
    mmap_large_allocations()
    plan = ShardPlan.build([("w", numel)], 1)
    config = ShardConfig(experiment="ck", shard=0, mode="async", staleness=None, total_steps=10**9,
                         optimizer=OptimizerConfig(name="sgd", lr=1e-3, momentum=0.9), checkpoint_every=every)
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks_of_shard(0)}
    server = ShardServer(config, plan, init, own_init=True)
    del init
    ck = AsyncCheckpointer(root, keep=1)
    steps: list[tuple[bool, bool, float, float]] = []  # (checkpoints on, a snapshot pending, seconds, ended at)
    opens: list[float] = []
    pending = [False]
    opened: list[Any] = [None]  # the newest snapshot_later's: a snapshot written from the live state (`.done`)
    state = server._state  # noqa: SLF001 — the bench times each optimizer step
    step = state.step

    def is_pending() -> bool:
        """A snapshot opened and not yet delivered to the writer (a copier's), or not yet written (a stream's)."""
        return pending[0] or not getattr(opened[0], "done", True)

    def timed_step(grads: dict[int, torch.Tensor], lr_factor: float, **how: Any) -> float:
        was = is_pending()
        t0 = time.thread_time()
        out = step(grads, lr_factor, **how)
        steps.append((ckpt_on.is_set(), was, time.thread_time() - t0, time.time()))
        return out

    def deliver(snap: Any) -> None:
        pending[0] = False
        ck.submit(snap)

    def on_snapshot(version: int) -> None:  # as server_role._take_snapshot
        if not ckpt_on.is_set() or ck.busy:
            return
        t0 = time.thread_time()
        pending[0] = True
        opened[0] = server.snapshot_later(version, deliver)
        opens.append(time.thread_time() - t0)

    state.step = timed_step  # type: ignore[method-assign]
    server.on_snapshot = on_snapshot
    q.put(server.bind())
    server.start()
    stop.wait()
    deadline = time.monotonic() + 120
    while is_pending() and time.monotonic() < deadline:  # a snapshot still being copied reaches the writer
        time.sleep(0.05)
    ck.wait(120)
    q.put({"peak_mb": _vm_hwm_mb(), "steps": steps, "opens": opens, "saved": ck.saved, "skipped": ck.skipped, "failed": ck.failed,
           "write_s": ck.last_seconds, "serve_copy_s": server.snapshot_serve_seconds,
           "stats": {k: v for k, v in server.stats().items() if k in ("cow_copies", "cow_s", "apply_s",
                                                                         "snapshot_chunks_copied",
                                                                         "snapshot_chunks_adopted")}})
    server.close()


def _vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return float("nan")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else float("nan")


def _pusher(client: ShardClient, grads: dict[int, torch.Tensor], ckpt_on: Any, halt: threading.Event,
            out: list[tuple[bool, float, float, float]]) -> None:
    """One worker: push+pull in a loop; (checkpoints on, latency, started, ended) per push (wall clock)."""
    version = client.pull().versions[0]
    clock = 0
    while not halt.is_set():
        on, t0, w0 = ckpt_on.is_set(), time.perf_counter(), time.time()
        version = client.push_pull(grads, clock=clock, basis={0: version}).versions[0]
        out.append((on, time.perf_counter() - t0, w0, time.time()))
        clock += 1


def run(numel: int, every: int, blocks: int, per_block: int, workers: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q, stop, ckpt_on = ctx.Queue(), ctx.Event(), ctx.Event()
    root = tempfile.mkdtemp(prefix="gossamer-ckstall-")
    proc = ctx.Process(target=_server, args=(q, stop, ckpt_on, numel, every, root))
    proc.start()
    plan = ShardPlan.build([("w", numel)], 1)
    mine = [c.index for c in plan.chunks_of_shard(0)]
    endpoint = q.get(timeout=300)
    clients = [ShardClient(experiment="ck", sender=f"bench:{w}", plan=plan, endpoints={0: endpoint}, chunks=mine,
                           timeout_s=300) for w in range(workers)]
    latencies: list[tuple[bool, float, float, float]] = []
    halt = threading.Event()
    threads: list[threading.Thread] = []
    try:
        for c in clients:
            c.hello(fresh=True)
        grads = {i: torch.full((plan.chunks[i].numel,), 1e-6) for i in mine}  # read by every pusher
        threads = [threading.Thread(target=_pusher, args=(c, grads, ckpt_on, halt, latencies), daemon=True)
                   for c in clients]
        for t in threads:
            t.start()
        for block in range(2 * blocks + 1):  # warm-up, then off, on, off, on, ...
            (ckpt_on.set if block % 2 == 0 and block else ckpt_on.clear)()
            target = len(latencies) + (per_block if block else workers)
            while len(latencies) < target and all(t.is_alive() for t in threads):
                time.sleep(0.05)
            say(f"  block {block}: {len(latencies)} pushes, last {latencies[-1][1] * 1e3:.0f} ms "
                f"(checkpoints {'on' if ckpt_on.is_set() else 'off'})")
        warm = workers
    finally:
        halt.set()
        for t in threads:
            t.join(timeout=300)
        for c in clients:
            c.leave()
            c.close()
        stop.set()
        server = q.get(timeout=300)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        for p in sorted(Path(root).rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        Path(root).rmdir()
    return {"latencies": latencies[warm:], **server}


def summarise(label: str, numel: int, every: int, r: dict[str, Any]) -> dict[str, Any]:
    steps = r["steps"][2:]  # the warm-up pushes' steps
    quiet = [s for on, _, s, _ in steps if not on]
    pending = [(s, end) for _, p, s, end in steps if p]
    base = statistics.median(quiet)
    opens = r["opens"][1:] or r["opens"]  # the first also computes the environment's fingerprint (cached)
    ckpts = max(1, len(r["opens"]))
    serve_s = statistics.median(opens) * ckpts + sum(s - base for s, _ in pending)
    lat = r["latencies"]
    lat_off = [x for on, x, _, _ in lat if not on]
    lat_on = [x for on, x, _, _ in lat if on]
    # The pushes in flight while a step ran with a snapshot pending.
    lat_pending = [x for _, x, w0, w1 in lat if any(w0 <= end <= w1 for _, end in pending)]
    ms = 1e3
    return {
        "label": label, "numel_m": numel / 1e6, "state_mb": 2 * 4 * numel / MB, "every": every,
        "checkpoints": len(r["opens"]), "saved": r["saved"], "skipped": r["skipped"],
        "serve_ms_per_ckpt": serve_s / ckpts * ms,
        "open_ms": statistics.median(opens) * ms if opens else float("nan"),
        "serve_copy_ms_per_ckpt": r["serve_copy_s"] / ckpts * ms,
        "step_ms_quiet": base * ms,
        "step_ms_pending": statistics.mean(s for s, _ in pending) * ms if pending else float("nan"),
        "pending_steps": len(pending),
        "push_p50_ms_off": _pct(lat_off, 50) * ms, "push_p99_ms_off": _pct(lat_off, 99) * ms,
        "push_max_ms_off": max(lat_off) * ms,
        "push_p50_ms_on": _pct(lat_on, 50) * ms, "push_p99_ms_on": _pct(lat_on, 99) * ms,
        "push_max_ms_on": max(lat_on) * ms,
        "push_mean_ms_pending": statistics.mean(lat_pending) * ms if lat_pending else float("nan"),
        "write_s": r["write_s"], "peak_mb": r.get("peak_mb", float("nan")), "cow_copies": r["stats"].get("cow_copies", 0),
        "chunks_copied": r["stats"].get("snapshot_chunks_copied", ""),
        "chunks_left_by_writes": r["stats"].get("snapshot_chunks_adopted", ""),
    }


NOTES = ("One ShardServer process holding {numel:.0f}M fp32 values with SGD momentum ({state:.0f} MB of state), "
         "checkpointing every {every} versions through the real AsyncCheckpointer, pushed to by {workers} ShardClients "
         "at once (full gradients, PARAMS reply), in blocks alternating checkpoints off and on. The columns: "
         "bench/README.md.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default=None, help="a labelled run: written to bench/out/")
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=3, help="pairs of blocks (checkpoints off, then on)")
    ap.add_argument("--per-block", type=int, default=12, help="pushes per block")
    ap.add_argument("--workers", type=int, default=2, help="clients pushing at once (a push waits in the queue "
                    "while another is applied, so one meets each snapshot just opened)")
    args = ap.parse_args()
    say(f"{args.label or 'current'}: {args.numel / 1e6:.0f}M values, checkpoint every {args.every}")
    r = run(args.numel, args.every, args.blocks, args.per_block, args.workers)
    row = summarise(args.label or "current", args.numel, args.every, r)
    say(json.dumps(row))
    write_report("checkpoint_stall", [row],
                 NOTES.format(workers=args.workers, numel=args.numel / 1e6, state=2 * 4 * args.numel / MB, every=args.every),
                 label=args.label)


if __name__ == "__main__":
    main()
