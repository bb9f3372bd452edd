"""Every codec x {MLP, CNN, char LM} x {momentum 0, 0.9} over seeds: final metric mean and spread, bytes, time to target.

    python -m bench.compression [--steps 1500] [--seeds 3] [--workers 3] [--models mlp,cnn,lm]
                                [--codecs none,sign,...] [--momenta 0,0.9] [--quick]

Async mode, shards on loopback ZMQ in threads and workers in threads of one process, so the
rows compare with each other. A digits cell misses when its mean accuracy is more than 1 point
under `none`'s (same model and momentum), an LM cell when its mean eval loss is more than 5%
over `none`'s; a missed cell stays in the table, marked, with what was tried. Writes
bench/results/compression.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from tempfile import TemporaryDirectory
from typing import Any

import torch

from bench._report import report_path, write_report
from gossamer.core.experiment import Experiment
from gossamer.engine.rank import RankContext
from gossamer.paramserver.local import LocalShards
from gossamer.training.shards.ps_trainer import ParameterServerTrainer

CODECS = ["none", "fp16", "bf16", "int8", "qsgd:16", "topk:0.01", "randk:0.1", "powersgd:4", "sign"]
LM_ARGS = {"d_model": 32, "n_layers": 1, "n_heads": 4, "seq_len": 32}
#: model, dataset, extra experiment fields, metric ("accuracy": higher is better; "loss": lower).
MODELS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "mlp": ("gossamer.examples.digits:mlp", "gossamer.examples.digits:data", {"lr": 0.05}, "accuracy"),
    "cnn": ("gossamer.examples.digits:cnn", "gossamer.examples.digits:cnn_data", {"lr": 0.05}, "accuracy"),
    "lm": ("gossamer.examples.charlm:model", "gossamer.examples.charlm:data",
           {"lr": 0.05, "max_grad_norm": 1.0, "model_args": LM_ARGS,
            "dataset_args": {"seq_len": 32, "max_chars": 200_000},
            "eval_samples": 1000}, "loss"),
}
#: Time to target: digits accuracy 0.95; LM eval loss 2.6 nats/char (unigram about 3.2 at this size).
TARGET = {"accuracy": 0.95, "loss": 2.6}
#: What was tried for a cell that missed before (shown with the mark).
TRIED = {
    "sign": "worker momentum (EF-SGD with momentum), the scale min(rms, 1.5 mean |x|) and 1-D parameters sent as fp32; "
            "at momentum 0.9 the shards' momentum gave 0.383/0.078, the mean scale 0.958 on the MLP",
    "topk:0.01": "DGC momentum correction + factor masking + density warm-up",
    "randk:0.1": "unbiased sample of the worker momentum (x 1/R, no error feedback); EF + DGC masking gave 0.46/0.09",
}


def run(model: str, codec: str, momentum: float, seed: int, steps: int, workers: int) -> dict[str, Any]:
    """One training run; its final metric, bytes per step and time to the target."""
    model_path, data_path, extra, metric = MODELS[model]
    exp = Experiment(name="bench", model=model_path, dataset=data_path, mode="async", momentum=momentum,
                     num_ps_shards=2, total_steps=steps, eval_every=max(10, steps // 10), compression=codec,
                     seed=seed, **extra)
    shards = LocalShards(exp)
    evals: list[tuple[float, float]] = []
    t0 = time.perf_counter()

    def on_metrics(step: int, values: dict[str, float]) -> None:
        if f"eval_{metric}" in values:
            evals.append((time.perf_counter() - t0, values[f"eval_{metric}"]))

    with TemporaryDirectory() as ckpt:
        trainers = [
            ParameterServerTrainer(RankContext(experiment_id="e", experiment=exp, node_id=f"n{w}", worker_index=w,
                                num_workers=workers, endpoints=shards.endpoints, checkpoint_dir=ckpt, lead=w == 0),
                    on_metrics=on_metrics if w == 0 else None)
            for w in range(workers)
        ]
        t0 = time.perf_counter()
        threads = [threading.Thread(target=t.run) for t in trainers]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    shards.close()
    pushes = max(1, sum(t.stats.steps for t in trainers))
    good = (lambda v: v >= TARGET[metric]) if metric == "accuracy" else (lambda v: v <= TARGET[metric])
    hit = next((t for t, v in evals if good(v)), None)
    return {"final": evals[-1][1] if evals else float("nan"), "wall_s": wall, "time_to_target_s": hit,
            "bytes_up_per_step": sum(t.client.bytes_up for t in trainers) / pushes}


def cell(model: str, codec: str, momentum: float, seeds: int, steps: int, workers: int,
         first_seed: int = 0) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    runs = [run(model, codec, momentum, s, steps, workers) for s in range(first_seed, first_seed + seeds)]
    finals = [r["final"] for r in runs]
    hits = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    return {
        "model": model, "codec": codec, "momentum": momentum, "metric": MODELS[model][3],
        "mean": round(statistics.fmean(finals), 4),
        "spread": round(max(finals) - min(finals), 4), "runs": [round(f, 4) for f in finals],
        "bytes_up_per_step": round(statistics.fmean(r["bytes_up_per_step"] for r in runs)),
        "time_to_target_s": round(statistics.fmean(hits), 2) if len(hits) == len(runs) else None,
        "wall_s": round(statistics.fmean(r["wall_s"] for r in runs), 2),
        "load_1min": f"{load_before:.1f}-{os.getloadavg()[0]:.1f}",  # time columns depend on it, metrics not
    }


def judge(rows: list[dict[str, Any]]) -> None:
    """Mark each row against `none` of the same model and momentum (within 1 point / 5%)."""
    base = {(r["model"], r["momentum"]): r for r in rows if r["codec"] == "none"}
    for r in rows:
        b = base.get((r["model"], r["momentum"]))
        if b is None:
            r["vs_none"] = r["status"] = ""
            continue
        r["ratio_up_vs_none"] = round(b["bytes_up_per_step"] / r["bytes_up_per_step"], 1)
        if r["metric"] == "accuracy":
            r["vs_none"] = round(r["mean"] - b["mean"], 4)
            ok = r["vs_none"] >= -0.01
        else:
            r["vs_none"] = round(r["mean"] / b["mean"] - 1, 4)
            ok = r["vs_none"] <= 0.05
        tried = TRIED.get(r["codec"]) if r["momentum"] else None  # worker momentum needs momentum > 0
        r["status"] = "ok" if ok else "MISS: " + (tried or "nothing codec-specific yet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--models", default="mlp,cnn,lm")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--momenta", default="0,0.9")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first_seed .. first_seed + seeds - 1")
    ap.add_argument("--quick", action="store_true", help="300 steps, 1 seed, MLP only")
    ap.add_argument("--label", default=None, help="a labelled run: written to bench/out/compression_<label>")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in the run's file and add these (a run split in parts)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps, seeds = (300, 1) if args.quick else (args.steps, args.seeds)
    models = ["mlp"] if args.quick else args.models.split(",")
    rows = []
    old = report_path("compression", args.label)
    if args.append and old.exists():
        rows = json.loads(old.read_text())["rows"]
    for model in models:
        for momentum in (float(m) for m in args.momenta.split(",")):
            for codec in args.codecs.split(","):
                rows.append(cell(model, codec, momentum, seeds, steps, args.workers, args.first_seed))
                print(rows[-1], flush=True)
                judge(rows)
                write_report("compression", rows, notes(args.workers, steps, seeds, args.first_seed), label=args.label)


def notes(workers: int, steps: int, seeds: int, first_seed: int = 0) -> str:
    which = f" (seeds {first_seed}-{first_seed + seeds - 1})" if first_seed else ""
    return (f"async, {workers} workers, 2 shards, {steps} steps, {seeds} seed(s) per cell{which} (mean, spread = max - min); "
            "digits lr 0.05, LM SGD lr 0.05 clipped at norm 1 (1-layer d=32 char transformer, eval loss in nats/char); sign, topk and "
            "randk run the momentum on the worker (EF-SGD with momentum / DGC / randk's unbiased sample), the others on the shards; bytes are "
            "whole ZMQ messages; time to target: accuracy 0.95 / loss 2.6, mean over seeds when every seed got there")


if __name__ == "__main__":
    main()
