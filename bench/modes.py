"""Every mode (sync, async, gossip, diloco with a sync, async or gossip outer step) on the same workloads, against sync.

    python -m bench.modes [--steps 400] [--seeds 3] [--workers 3] [--models mlp,cnn] [--modes ...] [--quick] [--label LABEL]

Real processes: a LocalCluster (coordinator, one on-demand node for the shards, `--workers`
spot nodes) runs each experiment submitted through the client, one after another. Every run
gets the same budget of worker steps (`--steps` per worker: sync, gossip and diloco count a
worker's own steps, async and diloco/async every worker's together). Modes run at their
documented defaults: SGD lr 0.05 momentum 0.9 for sync, async and gossip; diloco's AdamW
(lr 0.003), int8 pseudo-gradients, H = 20, outer lr 0.7 and outer momentum 0.6 (not the DiLoCo
paper's 0.9: README, DiLoCo). A cell misses when its mean accuracy is more than 1 point
under sync's. The gossip modes also give the lead's final consensus distance (mean squared distance
of the nodes' parameters to their average). Writes bench/results/modes.{json,md} (a --label run: bench/out/modes_<label>.{json,md}).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench._report import write_report
from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster

MODELS = {
    "mlp": {"model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"},
    "cnn": {"model": "gossamer.examples.digits:cnn", "dataset": "gossamer.examples.digits:cnn_data"},
}
SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
#: label -> (experiment fields, whether total_steps counts every worker's steps together)
MODES: dict[str, tuple[dict[str, Any], bool]] = {
    "sync": ({"mode": "sync", **SGD}, False),
    "async": ({"mode": "async", **SGD}, True),
    "gossip": ({"mode": "gossip", **SGD}, False),
    "diloco/sync": ({"mode": "diloco", "outer_step": "sync", "lr": 0.003}, False),
    "diloco/async": ({"mode": "diloco", "outer_step": "async", "lr": 0.003}, True),
    "diloco/gossip": ({"mode": "diloco", "outer_step": "gossip", "lr": 0.003}, False),
}
#: What was tried for a mode that missed (shown with the mark).
TRIED = {
    "gossip": ("waiting for the last step's shares before mixing (ShareWait) gave 0.967/0.968 with final "
               "consensus 1.7-2.5 (weights drained): reverted; the lag bound (LagBound) gave 0.972/0.975 (3 seeds), "
               "0.975 (6 seeds) against 0.965 before"),
    "diloco/sync": "outer momentum 0.6 (0.9 grew the weights)",
    "diloco/async": "Delayed Nesterov on the workers' shares, outer momentum 0.6; Nesterov per arrival gave 0.63",
    "diloco/gossip": "outer step on the own pseudo-gradient, then the round's shares mixed in",
}


def verdict(row: dict[str, Any]) -> str:
    return "ok" if row["vs_sync"] >= -0.01 else "MISS: " + TRIED.get(row["mode"], "")


def run(client: Client, model: str, label: str, seed: int, steps: int, workers: int) -> dict[str, Any]:
    fields, pooled = MODES[label]
    total = steps * workers if pooled else steps
    spec = {"name": f"modes-{label.replace('/', '-')}-{model}-{seed}", **MODELS[model], **fields,
            "num_ps_shards": 1 if "gossip" not in label else 0, "min_workers": workers, "max_workers": workers,
            "total_steps": total, "eval_every": total, "seed": seed}
    t0 = time.perf_counter()
    result = client.submit(spec).wait(timeout=1800)
    wall = time.perf_counter() - t0
    m = result.metrics
    return {"status": result.status, "accuracy": m.get("eval_accuracy", float("nan")), "wall_s": wall,
            "bytes": m.get("bytes_up", 0) + m.get("bytes_down", 0), "consensus": m.get("consensus_distance")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=400, help="steps per worker")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--quick", action="store_true", help="200 steps per worker, 1 seed, MLP only")
    ap.add_argument("--label", default=None, help="a labelled run: written to bench/out/modes_<label>")
    args = ap.parse_args()
    steps, seeds = (200, 1) if args.quick else (args.steps, args.seeds)
    models = ["mlp"] if args.quick else args.models.split(",")
    rows: list[dict[str, Any]] = []
    with LocalCluster(heartbeat_interval=0.5, lease_timeout=5.0, stop_grace_s=0.0) as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        cluster.wait_joined("ps")  # the on-demand node first, so the shards land on it
        for i in range(args.workers):
            cluster.add_node(f"w{i}", spot=True)
        cluster.wait_joined(*(f"w{i}" for i in range(args.workers)), timeout=180)
        try:
            for model in models:
                for label in args.modes.split(","):
                    runs = [run(client, model, label, s, steps, args.workers) for s in range(seeds)]
                    accs = [r["accuracy"] for r in runs]
                    rows.append({
                        "model": model, "mode": label, "mean_accuracy": round(statistics.fmean(accs), 4),
                        "spread": round(max(accs) - min(accs), 4), "runs": [round(a, 4) for a in accs],
                        "status": ",".join(sorted({r["status"] for r in runs})),
                        "bytes_per_run": round(statistics.fmean(r["bytes"] for r in runs)),
                        "wall_s": round(statistics.fmean(r["wall_s"] for r in runs), 1),
                    })
                    if all(r["consensus"] is not None for r in runs):
                        rows[-1]["consensus_distance"] = float(f"{statistics.fmean(r['consensus'] for r in runs):.3g}")
                    sync = next((r for r in rows if r["model"] == model and r["mode"] == "sync"), None)
                    for r in rows:
                        if sync is not None and r["model"] == model:
                            r["vs_sync"] = round(r["mean_accuracy"] - sync["mean_accuracy"], 4)
                            r["verdict"] = verdict(r)
                    print(rows[-1], flush=True)
                    write_report("modes", rows, notes(args.workers, steps, seeds), label=args.label)
        finally:
            client.close()


def notes(workers: int, steps: int, seeds: int) -> str:
    return (f"{workers} worker processes (+1 shard node), {steps} steps per worker, {seeds} seed(s) per cell "
            "(mean, spread = max - min); each mode at its documented defaults (module docstring); bytes are "
            "the run's bytes_up + bytes_down; wall includes scheduling")


if __name__ == "__main__":
    main()
