"""Inside one node: peak memory of DDP vs FSDP2, pipeline bubbles (GPipe, 1F1B), and each layout's throughput.

Run: ``python -m bench.intranode [--quick] [--out DIR]``. Writes DIR/intranode.{json,md} (default bench/results).

One MLP of `layers` Linear(width, width) layers (ReLU between), AdamW, MSE on a synthetic regression
batch drawn from a seed, trained on CPU with gloo by spawned ranks (torch.multiprocessing, spawn, one
torch thread each, 2 ranks: this machine has 2 cores). Every layout starts from the same weights
(each layer seeded by its index) and sees the same global batches, so the first-step loss must agree.

1. memory: peak RSS growth per rank (ru_maxrss at the end minus RSS at a baseline taken after the
   process group and the layout's imports, before the model) for single, ddp (torch DDP), fsdp (FSDP2
   ``fully_shard``, built on the meta device) and a 2-stage pipeline. Measured twice: in runs with a
   fixed 1 MiB glibc mmap threshold (RSS then follows live tensor bytes) and, as a second row, in the
   throughput runs under glibc's default malloc (what a user gets; heap fragmentation included).
2. bubble: ``torch.distributed.pipelining`` ScheduleGPipe / Schedule1F1B, p=2 stages, m micro-batches;
   per rank and step bubble = 1 - busy/wall, busy = time inside the stage's forward_one_chunk and
   backward_one_chunk (compute; sends/recvs happen outside them), wall = the step's makespan (both
   ranks start the schedule's step after a barrier; the slower one's step time); averaged over both
   ranks and the steps after warm-up; theory (p-1)/(m+p-1).
3. throughput: samples/s of ddp, fsdp, GPipe and 1F1B (m=4) over the same global batch, against a
   single process (one thread) run at the start and again at the end of the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import socket
import statistics
import tempfile
import time
from typing import Any

import torch.multiprocessing as tmp

from bench._intranode_worker import run
from bench._report import write_report

WORLD = 2
SWEEP = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8)]
MEMORY_LAYOUTS = ("single", "ddp", "fsdp", "pipeline")
BUILT = {
    "single": "full model on CPU",
    "ddp": "full model on every rank, torch DDP (bucketed all-reduce, grads as bucket views)",
    "fsdp": "meta device, fully_shard per Linear then root, to_empty; init copied in one layer at a time",
    "pipeline": "each rank builds only its stage's layers",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(spec: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Spawn `world` ranks of bench/_intranode_worker.py on `spec`; their results, by rank."""
    import json

    for attempt in range(3):
        with tempfile.TemporaryDirectory(prefix="intranode-") as out:
            try:
                tmp.start_processes(run, args=(world, _free_port(), spec, out), nprocs=world,
                                    start_method="spawn")
            except tmp.ProcessRaisedException as e:
                # the free port can be taken between our probe and rank 0's bind
                if "address already in use" in str(e).lower() and attempt < 2:
                    continue
                raise
            return [json.loads(pathlib.Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    raise AssertionError("unreachable")


def _state_mb(layers: int, width: int, share: float) -> float:
    """Params + grads + AdamW's two moments, fp32, for `share` of the model."""
    return 4 * (layers * (width * width + width)) * 4 * share / 2**20


def _row(section: str, layout: str, metric: str, measured: float, reference: float, ideal: float | str,
         note: str) -> dict[str, Any]:
    return {"section": section, "layout": layout, "metric": metric, "measured": measured,
            "reference": reference, "ratio": measured / reference, "ideal ratio": ideal, "note": note}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 layers of width 1024, fewer steps (< 60 s)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="results folder (default bench/results)")
    args = ap.parse_args()
    base: dict[str, Any] = {"layers": 4 if args.quick else 8, "width": 1024 if args.quick else 2048, "batch": 64,
                            "seed": 0, "lr": 1e-4}
    warm, steps = (1, 2) if args.quick else (2, 6)
    layers, width = base["layers"], base["width"]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()

    def go(layout: str, world: int, **kw: Any) -> list[dict[str, Any]]:
        res = launch({**base, "layout": layout, **kw}, world)
        print(f"{layout} {kw.get('mmap_threshold') and 'mmap-threshold ' or ''}done "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        return res

    mmap = {"mmap_threshold": 2**20}
    # 1. memory, in runs of their own (ru_maxrss is per process): step 2 runs with AdamW's state in place.
    # --quick skips them and reads memory from the throughput runs, which then run with the mmap threshold
    mem = {} if args.quick else {
        layout: go(layout, 1 if layout == "single" else WORLD, warmup=1, steps=1, pipeline=[("gpipe", 4)], **mmap)
        for layout in MEMORY_LAYOUTS}
    # 2 + 3. throughput (and the pipeline sweep), glibc's default malloc, single first and last
    kw: dict[str, Any] = {"warmup": warm, "steps": steps, **(mmap if args.quick else {})}
    thr = {"single": go("single", 1, **kw)}
    thr["ddp"] = go("ddp", WORLD, **kw)
    thr["fsdp"] = go("fsdp", WORLD, **kw)
    # one warm-up step per schedule is enough (the first infers shapes); 7 schedules make this the longest run
    thr["pipeline"] = go("pipeline", WORLD, pipeline=SWEEP, **{**kw, "warmup": 1})
    thr["single (end)"] = go("single", 1, **kw)
    load1 = os.getloadavg()[0]
    total_s = time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    share = {"single": 1.0, "ddp": 1.0, "fsdp": 1 / WORLD, "pipeline": 1 / WORLD}

    def peak(res: list[dict[str, Any]]) -> float:
        return statistics.mean(r["peak_growth_mb"] for r in res)

    def per_rank(res: list[dict[str, Any]]) -> str:
        return "/".join(f"{r['peak_growth_mb']:.0f}" for r in res)

    sources = [("mmap", thr)] if args.quick else [("mmap", mem), ("default", thr)]
    ddp_ref = {kind: peak(source["ddp"]) for kind, source in sources}
    run_of = {("mmap", "pipeline"): " (GPipe m=4)" if not args.quick else " (the schedule sweep)",
              ("default", "pipeline"): " (the schedule sweep)"}
    for kind, source in sources:
        for layout in MEMORY_LAYOUTS:
            res = source[layout]
            late = "" if all(r["peak_set_after_baseline"] for r in res) else "; PEAK NOT ABOVE THE BASELINE'S"
            what = "glibc default malloc, throughput run" if kind == "default" else (
                "1 MiB mmap threshold, throughput run" if args.quick else "1 MiB mmap threshold")
            rows.append(_row(
                "memory", layout, f"peak RSS growth MB/rank ({what})", peak(res), ddp_ref[kind],
                share[layout] / share["ddp"],
                f"{BUILT[layout]}{run_of.get((kind, layout), '')}; per rank {per_rank(res)} MB; params+grads+AdamW state "
                f"{_state_mb(layers, width, share[layout]):.0f} MB/rank in theory{late}"))

    single = [thr["single"][0]["samples_per_s_median"], thr["single (end)"][0]["samples_per_s_median"]]
    ref = statistics.mean(single)
    p = WORLD
    for run_ in thr["pipeline"][0]["runs"]:
        kind, m = run_["schedule"], run_["microbatches"]
        per_stage = []
        for r in thr["pipeline"]:
            this = next(x for x in r["runs"] if x["schedule"] == kind and x["microbatches"] == m)
            per_stage.append([1 - b / w for b, w in zip(this["step_busy_s"], this["step_wall_s"], strict=True)])
        theory = (p - 1) / (m + p - 1)
        walls = [w for r in thr["pipeline"] for x in r["runs"] if x["schedule"] == kind and x["microbatches"] == m
                 for w in x["step_wall_s"]]
        rows.append(_row(
            "bubble", f"{'GPipe' if kind == 'gpipe' else '1F1B'} p={p} m={m}", "bubble fraction",
            statistics.mean(v for s in per_stage for v in s), theory, 1.0,
            f"reference = theory (p-1)/(m+p-1); stage 0 {statistics.mean(per_stage[0]):.3f}, stage 1 "
            f"{statistics.mean(per_stage[1]):.3f}; step {1e3 * statistics.median(walls):.0f} ms median"))

    def mean_rate(r: dict[str, Any], cpu_s: float | None = None) -> str:
        cores = (r["cpu_s"] if cpu_s is None else cpu_s) / r["timed_s"]
        return f"mean over the timed steps {r['samples_per_s']:.1f} samples/s; CPU used {cores:.2f} cores"

    rows.append(_row("throughput", "single (start)", "samples/s", single[0], ref, 1.0,
                     "1 process, 1 thread, whole global batch; reference = mean of start and end runs; "
                     + mean_rate(thr["single"][0])))
    rows.append(_row("throughput", "single (end)", "samples/s", single[1], ref, 1.0,
                     "same, repeated last; " + mean_rate(thr["single (end)"][0])))
    grad_mb = 4 * layers * (width * width + width) / 2**20
    traffic = {"ddp": f"all-reduce of {grad_mb:.0f} MB of grads per step",
               "fsdp": f"all-gather of {grad_mb:.0f} MB of params twice (forward, backward) and reduce-scatter "
                       f"of {grad_mb:.0f} MB of grads per step"}
    for layout in ("ddp", "fsdp"):
        rows.append(_row("throughput", f"{layout} x{WORLD}", "samples/s", thr[layout][0]["samples_per_s_median"],
                         ref, float(WORLD), f"{base['batch'] // WORLD} samples per rank; {traffic[layout]}; "
                         f"ideal = {WORLD} cores, free communication; "
                         + mean_rate(thr[layout][0], sum(r["cpu_s"] for r in thr[layout]))))
    act_mb = 4 * base["batch"] * width / 2**20
    for kind, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        run_ = next(x for x in thr["pipeline"][0]["runs"] if x["schedule"] == kind and x["microbatches"] == 4)
        cpu_pipe = sum(x["cpu_s"] for r in thr["pipeline"] for x in r["runs"]
                       if x["schedule"] == kind and x["microbatches"] == 4)
        rows.append(_row("throughput", f"{label} p={p} m=4", "samples/s", run_["samples_per_s_median"], ref,
                         p * 4 / (4 + p - 1), f"micro-batch {base['batch'] // 4}; {act_mb:.1f} MB of activations "
                         f"forward and as much gradient back per step; ideal = p x (1 - bubble); "
                         + mean_rate(run_, cpu_pipe)))

    first = {"single": thr["single"][0]["losses"][0], "ddp": thr["ddp"][0]["losses"][0],
             "fsdp": thr["fsdp"][0]["losses"][0], "pipeline": thr["pipeline"][0]["losses"][0]}
    for layout, loss in first.items():
        rows.append(_row("loss", layout, "first-step loss", loss, first["single"], 1.0,
                         f"same weights and batches in every layout; {loss:.7f}, {loss - first['single']:+.1e} "
                         "vs single (float rounding)"))
    for r in rows:
        if not all(math.isfinite(r[k]) for k in ("measured", "reference", "ratio")):
            raise RuntimeError(f"non-finite result: {r}")

    n = layers * (width * width + width)
    notes = (
        f"MLP of {layers} Linear({width}, {width}) ({n / 1e6:.1f}M params, {4 * n / 2**20:.0f} MB fp32), AdamW, "
        f"MSE on a seeded synthetic batch, global batch {base['batch']}; gloo on CPU, {WORLD} spawned ranks, "
        f"torch.set_num_threads(1) per rank. **memory**: peak RSS growth = ru_maxrss at the end - RSS at a "
        "baseline taken after the process group and the layout's imports, before the model; mean of the "
        "ranks (per rank in the note); ratio = vs ddp, ideal ratio = 1/W for the sharded state "
        "(params, grads, AdamW moments). "
        + ("--quick: every run uses mallopt(M_MMAP_THRESHOLD, 1 MiB) and memory is read from the throughput "
           "runs. " if args.quick else
           "The 1 MiB mmap-threshold rows come from runs of their own (2 steps, the second with AdamW's state in place) with "
           "mallopt(M_MMAP_THRESHOLD, 1 MiB), so every tensor above 1 MiB is unmapped when freed; the "
           "glibc-default rows are the same layouts' throughput runs (default malloc), where FSDP's freed "
           "per-layer all-gather/reduce-scatter buffers stay in the heap (fragmentation) and can push its RSS "
           "above DDP's. ")
        + "**bubble**: 1 - busy/wall per rank per step, busy = forward_one_chunk + "
        "backward_one_chunk, wall = makespan of schedule.step (both ranks start it after a barrier; the "
        "slower rank's time; no optimizer step), mean of both stages over "
        f"{steps} steps after 1 warm-up; step = median makespan; reference = theory (p-1)/(m+p-1), which assumes equal stages "
        "and free communication. Here communication is not free: the gloo sends and receives, and the "
        "other rank's work, share 2 CPU cores (also used by other jobs), so the measured bubble includes "
        "send/recv time. Schedule1F1B with m=1 < p is refused by torch (it is GPipe then), so it has no row. "
        "**throughput**: global batch / median step time over the timed steps (optimizer step included; "
        "the median resists bursts of load from other jobs, the mean is in the note), ratio vs the mean of the "
        "single-process runs at the start and the end of this run; the single process uses 1 thread, the "
        f"layouts {WORLD} ranks x 1 thread, so the ideal is {WORLD}x (pipeline: {WORLD} x (1 - theoretical "
        "bubble)) when each process has a core of its own; 'CPU used' (process CPU time / wall, summed over "
        f"the ranks) shows how much CPU each layout actually got. Machine: {os.cpu_count()} vCPUs (KVM) shared with other jobs (load average {load0:.1f} at the "
        f"start, {load1:.1f} at the end); whole run {total_s:.0f} s. Compare ratios, not absolute figures."
    )
    js, md = write_report("intranode", rows, notes, out_dir=args.out)
    print(md.read_text())


if __name__ == "__main__":
    main()
