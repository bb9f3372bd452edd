"""Parameter-server push+pull throughput vs raw ZMQ round trips and a gloo all_reduce.

Run: ``python -m bench.ps_throughput [--quick]``. Writes bench/results/ps_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch
import zmq

from bench._report import write_report
from gossamer.paramserver import (
    OptimizerConfig,
    ShardClient,
    ShardConfig,
    ShardPlan,
    ShardServer,
)
from gossamer.transport.frames import FrameLimits

LIMITS = FrameLimits(max_message_bytes=1 << 30)


def _shard_proc(plan_dict: dict, shard: int, q, stop) -> None:
    torch.set_num_threads(1)
    plan = ShardPlan.from_dict(plan_dict)
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks_of_shard(shard)}
    cfg = ShardConfig(
        experiment="bench",
        shard=shard,
        mode="async",
        staleness=None,
        optimizer=OptimizerConfig(name="sgd", lr=1e-6),
        total_steps=10**9,
        limits=LIMITS,
    )
    srv = ShardServer(cfg, plan, init)
    q.put((shard, srv.bind()))
    srv.start()
    stop.wait()
    srv.close()


def bench_ps(numel: int, shards: int, iters: int, start_timeout_s: float = 60.0) -> float:
    plan = ShardPlan.build([("flat", numel)], shards, -(-numel // 16))
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_shard_proc, args=(plan.to_dict(), s, q, stop)) for s in range(shards)
    ]
    for p in procs:
        p.start()
    try:
        endpoints = dict(q.get(timeout=start_timeout_s) for _ in procs)
        client = ShardClient(
            experiment="bench",
            sender="bench",
            plan=plan,
            endpoints=endpoints,
            timeout_s=120,
            limits=LIMITS,
        )
        client.hello()
        flat = torch.randn(numel) * 1e-3
        grads = plan.gather(flat)
        versions = client.pull().versions
        versions = client.push_pull(grads, clock=0, basis=versions).versions  # warm-up
        t0 = time.perf_counter()
        for i in range(iters):
            versions = client.push_pull(grads, clock=i + 1, basis=versions).versions
        dt = time.perf_counter() - t0
        client.close()
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
    return 2 * numel * 4 * iters / dt / 1e9


def _echo_proc(q, nbytes: int, rounds: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    q.put(f"tcp://127.0.0.1:{port}")
    reply = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        ident, _payload = sock.recv_multipart(copy=False)
        sock.send_multipart([ident, reply], copy=False)
    sock.close(linger=1000)
    ctx.term()


def bench_raw_zmq(numel: int, iters: int) -> float:
    nbytes = numel * 4
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_echo_proc, args=(q, nbytes, iters + 1))
    p.start()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(q.get(timeout=60))
    payload = memoryview(torch.randn(numel).numpy()).cast("B")
    sock.send(payload, copy=False)
    sock.recv(copy=False)
    t0 = time.perf_counter()
    for _ in range(iters):
        sock.send(payload, copy=False)
        sock.recv(copy=False)
    dt = time.perf_counter() - t0
    sock.close(linger=0)
    zctx.term()
    p.join(timeout=30)
    return 2 * nbytes * iters / dt / 1e9


def _gloo_proc(rank: int, port: int, numel: int, iters: int, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.randn(numel)
    dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    dt = time.perf_counter() - t0
    if rank == 0:
        q.put(dt)
    dist.destroy_process_group()


def bench_gloo(numel: int, iters: int) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_proc, args=(r, port, numel, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    dt = q.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return 2 * numel * 4 * iters / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="4M parameters, fewer iterations")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args()
    numel = 4_000_000 if args.quick else 25_000_000
    iters = args.iters or (5 if args.quick else 8)
    torch.set_num_threads(1)
    t = time.perf_counter()
    raw = bench_raw_zmq(numel, iters)
    print(f"raw zmq {raw:.3f} GB/s ({time.perf_counter() - t:.1f}s)", flush=True)
    gloo = bench_gloo(numel, iters)
    print(f"gloo {gloo:.3f} GB/s ({time.perf_counter() - t:.1f}s)", flush=True)
    rows = [
        {"transport": "raw ZMQ DEALER/ROUTER", "shards": 1, "GB/s": raw, "ps/raw": None},
        {"transport": "gloo all_reduce (2 procs)", "shards": "-", "GB/s": gloo, "ps/raw": None},
    ]
    for shards in (1, 2, 4):
        gbps = bench_ps(numel, shards, iters)
        print(f"ps {shards} shards {gbps:.3f} GB/s ({time.perf_counter() - t:.1f}s)", flush=True)
        rows.append(
            {
                "transport": "gossamer PS push+pull",
                "shards": shards,
                "GB/s": gbps,
                "ps/raw": gbps / raw,
            }
        )
    notes = (
        f"{numel / 1e6:.0f}M fp32 parameters ({numel * 4 / 1e6:.0f} MB), {iters} timed rounds after "
        "one warm-up, loopback, servers in spawned processes. GB/s = (bytes pushed + bytes "
        "pulled) / time; raw ZMQ = send + equal-size reply; gloo = 2 x tensor bytes per "
        f"all_reduce / time. Machine: {os.cpu_count()} CPUs. Target ps/raw >= 0.7."
    )
    for r in rows:
        if r["ps/raw"] is None:
            r["ps/raw"] = "-"
    write_report("ps_throughput", rows, notes)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
