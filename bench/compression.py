"""Per codec, async digits (MLP and CNN): accuracy, bytes per step, ratio to none, codec time, time to 95%.

    python bench/compression.py [--steps 1500] [--workers 3] [--quick]

Everything runs in one process and one run (shards on loopback ZMQ in threads, workers in
threads), so the rows compare with each other. Writes bench/results/compression.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS, write_report  # noqa: E402

from gossamer.compression import ChunkCompressor  # noqa: E402
from gossamer.experiment import Experiment  # noqa: E402
from gossamer.paramserver.local import LocalShards  # noqa: E402
from gossamer.worker.ps_trainer import ParameterServerTrainer  # noqa: E402
from gossamer.worker.rank import RankContext  # noqa: E402

CODECS = ["none", "fp16", "bf16", "int8", "qsgd:16", "topk:0.01", "powersgd:4", "sign"]
MODELS = {
    "mlp": ("gossamer.examples.digits:mlp", "gossamer.examples.digits:data"),
    "cnn": ("gossamer.examples.digits:cnn", "gossamer.examples.digits:cnn_data"),
}


def codec_ms_per_step(exp: Experiment, trainer: ParameterServerTrainer, reps: int = 30) -> float:
    """Encode + decode of one whole gradient, alone on one thread (in training, threads share the GIL)."""
    if exp.compression == "none":
        return 0.0
    plan = trainer.plan
    shapes = {n: tuple(p.shape) for n, p in trainer.model.named_parameters()}
    enc = ChunkCompressor(exp.compression, plan, shapes=shapes)
    dec = ChunkCompressor(exp.compression, plan, shapes=shapes, error_feedback=False)
    grad = torch.randn(plan.total_numel) * 1e-2
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in plan.chunks:
            wire, meta = enc.encode(c.index, grad[c.flat_offset : c.flat_offset + c.numel])
            dec.decode(c.index, wire, meta)
    return 1e3 * (time.perf_counter() - t0) / reps


def run(model: str, codec: str, steps: int, workers: int) -> dict[str, Any]:
    model_path, data_path = MODELS[model]
    exp = Experiment(name="bench", model=model_path, dataset=data_path, mode="async", lr=0.05, momentum=0.9,
                     num_ps_shards=2, total_steps=steps, eval_every=50, compression=codec)
    shards = LocalShards(exp)
    evals: list[tuple[float, float]] = []
    t0 = time.perf_counter()

    def on_metrics(step: int, values: dict[str, float]) -> None:
        if "eval_accuracy" in values:
            evals.append((time.perf_counter() - t0, values["eval_accuracy"]))

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
    pushes = sum(t.stats.steps for t in trainers)
    t95 = next((t for t, acc in evals if acc >= 0.95), None)
    return {
        "model": model, "codec": codec, "final_accuracy": round(evals[-1][1], 4) if evals else None,
        "bytes_up_per_step": round(sum(t.client.bytes_up for t in trainers) / pushes),
        "bytes_down_per_step": round(sum(t.client.bytes_down for t in trainers) / pushes),
        "codec_ms_per_step": round(codec_ms_per_step(exp, trainers[0]), 3),
        "time_to_95pct_s": None if t95 is None else round(t95, 2), "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="300 steps, MLP only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps = 300 if args.quick else args.steps
    rows = []
    for model in ["mlp"] if args.quick else list(MODELS):
        base = None
        for codec in CODECS:
            row = run(model, codec, steps, args.workers)
            base = base or row["bytes_up_per_step"]
            row["ratio_up_vs_none"] = round(base / row["bytes_up_per_step"], 1)
            rows.append(row)
            print(row, flush=True)
    write_report("compression", rows, f"async digits, {args.workers} workers, 2 shards, {steps} steps, "
                 "lr 0.05 momentum 0.9, error feedback on for biased codecs; bytes are whole ZMQ messages")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in sorted({r["model"] for r in rows}):
        pts = [r for r in rows if r["model"] == model]
        ax.scatter([r["bytes_up_per_step"] for r in pts], [r["final_accuracy"] for r in pts], label=model)
        for r in pts:
            ax.annotate(r["codec"], (r["bytes_up_per_step"], r["final_accuracy"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("bytes pushed per step (log)")
    ax.set_ylabel("final eval accuracy")
    ax.set_title("digits, async: accuracy vs bytes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "compression.png", dpi=120)


if __name__ == "__main__":
    main()
