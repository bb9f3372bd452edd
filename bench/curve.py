"""What CurveZMQ costs the data plane: push+pull throughput of a real shard with and without CURVE.

Run: ``python -m bench.curve [--quick]``. Writes bench/results/curve.{json,md}.

Two shards of the same model in spawned processes, one plaintext and one CURVE, and a
ShardClient of each here; a round pushes the whole model and pulls it back (``push_pull``).
Timed runs alternate between the two, `--repeats` times per model size, so both see the
same machine load; the table gives the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

from bench._report import write_report
from gossamer.paramserver import (
    OptimizerConfig,
    ShardClient,
    ShardConfig,
    ShardPlan,
    ShardServer,
)
from gossamer.security.curve import CurveKeyPair, CurveKeyring, keyring_from_spec


def _shard_proc(plan_dict: dict[str, Any], curve_spec: dict[str, Any], q: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    plan = ShardPlan.from_dict(plan_dict)
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks_of_shard(0)}
    cfg = ShardConfig(experiment="bench", shard=0, mode="async", staleness=None,
                      optimizer=OptimizerConfig(name="sgd", lr=1e-6), total_steps=10**9)
    srv = ShardServer(cfg, plan, init, curve=keyring_from_spec(curve_spec))
    q.put(srv.bind())
    srv.start()
    stop.wait()
    srv.close()


class Pair:
    """Two shards of one model in spawned processes, plaintext and CURVE, and a client of each."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.plan = ShardPlan.build([("flat", numel)], 1, -(-numel // 16))
        server_keys, client_keys = CurveKeyPair.generate(), CurveKeyPair.generate()
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = []
        endpoints = []
        for spec in ({}, {"curve_public": server_keys.public, "curve_secret": server_keys.secret,
                          "curve_members": [client_keys.public]}):
            q = ctx.Queue()
            proc = ctx.Process(target=_shard_proc, args=(self.plan.to_dict(), spec, q, self.stop))
            proc.start()
            self.procs.append(proc)
            endpoints.append(q.get(timeout=300))
        keyring = CurveKeyring(client_keys, server_keys={endpoints[1]: server_keys.public})
        self.clients = {
            curve: ShardClient(experiment="bench", sender="bench", plan=self.plan, endpoints={0: ep},
                               timeout_s=300, curve=keyring if curve else None)
            for curve, ep in ((False, endpoints[0]), (True, endpoints[1]))
        }
        self.grads = self.plan.gather(torch.randn(numel) * 1e-3)
        self.versions = {curve: {0: 0} for curve in self.clients}
        self.clock = 0
        for curve, c in self.clients.items():
            c.hello()
            self.round(curve)  # warm-up

    def round(self, curve: bool) -> None:
        self.clock += 1
        res = self.clients[curve].push_pull(self.grads, clock=self.clock, basis=self.versions[curve])
        self.versions[curve] = res.versions

    def timed(self, curve: bool, iters: int) -> float:
        """GB/s of (bytes pushed + bytes pulled) over `iters` push_pull rounds."""
        t0 = time.perf_counter()
        for _ in range(iters):
            self.round(curve)
        return 2 * self.numel * 4 * iters / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.stop.set()
        for p in self.procs:
            p.join(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one repeat, fewer rounds")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.quick else 7)
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    t = time.perf_counter()
    for numel, iters in ((1_000_000, 5 if args.quick else 10), (10_000_000, 2 if args.quick else 3)):
        runs: dict[bool, list[float]] = {False: [], True: []}
        pair = Pair(numel)
        try:
            for _ in range(repeats):
                for curve in (False, True):
                    runs[curve].append(pair.timed(curve, iters))
                    print(f"{numel * 4 / 1e6:.0f} MB curve={curve}: {runs[curve][-1]:.3f} GB/s "
                          f"({time.perf_counter() - t:.0f}s)", flush=True)
        finally:
            pair.close()
        plain, secured = statistics.median(runs[False]), statistics.median(runs[True])
        rows.append({"model": f"{numel * 4 / 1e6:.0f} MB ({numel / 1e6:.0f}M fp32)", "rounds": iters,
                     "plaintext GB/s": plain, "CURVE GB/s": secured, "CURVE/plaintext": secured / plain,
                     "CURVE runs": ", ".join(f"{x:.3f}" for x in runs[True]),
                     "plaintext runs": ", ".join(f"{x:.3f}" for x in runs[False])})
    load = os.getloadavg()[0]
    notes = (
        "Push+pull of the whole model through a shard (spawned process) and a ShardClient, loopback; a "
        "plaintext and a CURVE shard side by side. "
        "GB/s = (bytes pushed + bytes pulled) / time; median of "
        f"{repeats} alternating runs of the given rounds each, after one warm-up round. CURVE: libzmq's CurveZMQ "
        "(Curve25519 handshake, XSalsa20-Poly1305 per message, on each side's ZMQ I/O thread), ZAP "
        f"membership check at the handshake, a key lookup per message on the shard. Machine: {os.cpu_count()} "
        f"CPUs, shared with other jobs (load average {load0:.1f} at the start, {load:.1f} at the end): compare "
        "the ratio, measured under the same load, rather than the absolute figures."
    )
    write_report("curve", rows, notes)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
