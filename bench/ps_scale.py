"""Parameter-server push+pull against the number of shards: real shard processes here, then a model calibrated on them.

    python -m bench.ps_scale [--quick] [--shards 1,2,4,8]

Measured (bench/ps_throughput.py's `bench_ps`: real `ShardServer` processes, one `ShardClient`,
push_pull rounds over loopback): a full-size model (`--numel`, default 4M fp32) and a tiny one
(16K fp32) at each shard count. The tiny model gives the fixed cost of a round and its growth per
shard (`o0 + S*o1`); the full model then gives the per-byte time of a round beyond that.

Model, for S shards each on its own host and W workers each on its own host (the deployment of
docs/scale.md), a push+pull of M bytes each way per worker step:
  worker round time  t_w = o0 + S*o1 + 2M/min(B, R_c)
  shard busy time    t_s = W * (2M/S) / min(B, R_s)     (every worker's slice of this shard)
  aggregate GB/s     = W * 2M / max(t_w, t_s)
with B the NIC (`--nic-gbps`, default 25 Gb/s), R_c the client's and R_s one shard's per-byte rate
(calibrated here: one shard process with one client, so R_s is an upper bound of a loaded host's).
Writes bench/results/ps_scale.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import numpy as np

from bench._report import write_report
from bench.ps_throughput import bench_ps

TINY = 1 << 14


def round_s(numel: int, shards: int, iters: int) -> float:
    """Seconds per push_pull round of `numel` fp32 over `shards` real shard processes."""
    gbps = bench_ps(numel, shards, iters, start_timeout_s=600.0)  # torch imports crawl on a loaded machine
    return 2 * numel * 4 / (gbps * 1e9)


def calibrate(points: list[dict[str, Any]], numel: int) -> dict[str, float]:
    """o0, o1 (fixed round cost and its growth per shard) from the tiny model; R (bytes/s) from the full one."""
    s = np.array([p["shards"] for p in points], float)
    tiny = np.array([p["tiny_round_ms"] for p in points]) / 1e3
    o1, o0 = np.polyfit(s, tiny, 1)
    o1 = max(o1, 0.0)
    one = next(p for p in points if p["shards"] == 1)
    byte_s = one["round_ms"] / 1e3 - (o0 + o1)
    rate = 2 * numel * 4 / max(byte_s, 1e-9)
    return {"o0_ms": float(o0) * 1e3, "o1_ms": float(o1) * 1e3, "rate_gbps": rate / 1e9}


def predict(cal: dict[str, float], shards: int, workers: int, model_bytes: float, nic_gbps: float) -> float:
    """Aggregate push+pull GB/s of `workers` workers against `shards` shards (the model in the docstring)."""
    b = nic_gbps / 8 * 1e9
    r = min(b, cal["rate_gbps"] * 1e9)
    t_w = (cal["o0_ms"] + shards * cal["o1_ms"]) / 1e3 + 2 * model_bytes / r
    t_s = workers * (2 * model_bytes / shards) / r
    return workers * 2 * model_bytes / max(t_w, t_s) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M parameters, fewer rounds")
    ap.add_argument("--shards", default="1,2,4,8", help="real shard counts")
    ap.add_argument("--numel", type=int, default=0, help="fp32 parameters of the full model (default 4M)")
    ap.add_argument("--nic-gbps", type=float, default=25.0, help="per-host network, Gb/s, for the model")
    ap.add_argument("--model-mb", type=float, default=400.0, help="model size for the predicted rows, MB")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    numel = args.numel or ((1 << 20) if args.quick else (4 << 20))
    iters = 4 if args.quick else 8
    measured: list[dict[str, Any]] = []
    load_start = os.getloadavg()[0]
    for s in (int(x) for x in args.shards.split(",")):
        row = {"kind": "measured", "shards": s, "workers": 1,
               "round_ms": round(round_s(numel, s, iters) * 1e3, 2),
               "tiny_round_ms": round(round_s(TINY, s, iters * 4) * 1e3, 3)}
        row["gbps"] = round(2 * numel * 4 / (row["round_ms"] / 1e3) / 1e9, 3)
        measured.append(row)
        print(row, flush=True)
    cal = calibrate(measured, numel)
    for row in measured:
        row["model_gbps"] = round(predict(cal, row["shards"], 1, numel * 4, 1e6), 3)  # loopback: no NIC cap
    predicted = []
    model_bytes = args.model_mb * 1e6
    for s in (1, 2, 4, 8, 16, 32, 64):
        for per_shard in (1, 4):
            w = s * per_shard
            predicted.append({"kind": "model", "shards": s, "workers": w,
                              "gbps": round(predict(cal, s, w, model_bytes, args.nic_gbps), 2),
                              "gbps_per_shard": round(predict(cal, s, w, model_bytes, args.nic_gbps) / s, 2)})
    notes = (f"Measured: real shard processes on this machine ({len(measured)} points, {numel} fp32 = "
             f"{numel * 4 / 1e6:.0f} MB each way per round, one client; tiny model {TINY} fp32 for the fixed cost). "
             f"Calibration: o0 = {cal['o0_ms']:.2f} ms per round, o1 = {cal['o1_ms']:.3f} ms per shard, per-byte "
             f"rate {cal['rate_gbps']:.2f} GB/s (one shard process, one client). Model rows: {args.model_mb:g} MB "
             f"model, every shard and worker on its own host with a {args.nic_gbps:g} Gb/s NIC, W workers each "
             "pushing and pulling the whole model per step (see the module docstring). The machine has 2 shared "
             "cores: measured points past 2 shards time-share them, so they bound the real curve from below. "
             f"1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    write_report("ps_scale", measured + predicted, notes, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
