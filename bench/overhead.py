"""Step time of 1 worker + 1 parameter-server shard on the digits MLP vs a plain PyTorch loop, same run.

    python bench/overhead.py [--steps 2000] [--batch 32] [--repeats 3]

Writes bench/results/overhead.{json,md}. Target: gossamer / plain <= 1.5.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_report  # noqa: E402

from gossamer.experiment import Experiment  # noqa: E402
from gossamer.worker import sampler  # noqa: E402
from gossamer.worker.model import build  # noqa: E402
from gossamer.worker.ps_trainer import ParameterServerTrainer  # noqa: E402
from gossamer.worker.rank import RankContext  # noqa: E402


def _exp(steps: int, batch: int, mode: str) -> Experiment:
    overlap = mode == "async+overlap"
    return Experiment(name="overhead", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                      mode="async" if overlap else mode, overlap=overlap, lr=0.05, momentum=0.9,
                      batch_size=batch, num_ps_shards=1, total_steps=steps, eval_every=0)


def _serve(exp_json: str, q: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    import threading

    torch.set_num_threads(1)
    from gossamer.paramserver import (
        OptimizerConfig,
        ShardConfig,
        ShardPlan,
        ShardServer,
        flatten_params,
    )

    exp = Experiment.from_json(exp_json)
    model, _, _ = build(exp, torch.device("cpu"))
    plan = ShardPlan.for_module(model, 1)
    flat = flatten_params(model)
    srv = ShardServer(
        ShardConfig(experiment="bench", shard=0, mode=exp.mode, staleness=None, total_steps=exp.total_steps,
                    optimizer=OptimizerConfig(name="sgd", lr=exp.lr, momentum=exp.momentum)),
        plan, {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks},
    )
    q.put(srv.bind())
    ev = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), ev.set()), daemon=True).start()
    srv.serve(ev)  # in the main thread, as the parameter-server role runs it
    srv.close()


def plain_loop(exp: Experiment) -> float:
    """Seconds per step of the same model, data order and optimizer, in one process."""
    model, train, _ = build(exp, torch.device("cpu"))
    x_all, y_all = train.tensors
    opt = torch.optim.SGD(model.parameters(), lr=exp.lr, momentum=exp.momentum)
    t0 = time.perf_counter()
    for step in range(exp.total_steps):
        idx = sampler.async_batch(len(train), exp.batch_size, step, exp.seed, 0)
        opt.zero_grad()
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        opt.step()
    return (time.perf_counter() - t0) / exp.total_steps


def gossamer_loop(exp: Experiment) -> tuple[float, int]:
    """Seconds per step of one worker pushing to / pulling from one shard in another process."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    stop = ctx.Event()
    proc = ctx.Process(target=_serve, args=(exp.to_json(), q, stop))
    proc.start()
    try:
        endpoint = q.get(timeout=60)
        trainer = ParameterServerTrainer(RankContext(experiment_id="bench", experiment=exp, node_id="n", worker_index=0,
                                      num_workers=1, endpoints={0: endpoint}, checkpoint_dir="/tmp"))
        t0 = time.perf_counter()
        trainer.run()
        per_step = (time.perf_counter() - t0) / exp.total_steps
        return per_step, trainer.client.bytes_up + trainer.client.bytes_down
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mode in ("async", "async+overlap", "sync"):
        exp = _exp(args.steps, args.batch, mode)
        plain = [plain_loop(exp) for _ in range(args.repeats)]
        ours = [gossamer_loop(exp) for _ in range(args.repeats)]
        p, g = statistics.median(plain), statistics.median(t for t, _ in ours)
        rows.append({
            "mode": mode, "batch": args.batch, "steps": args.steps,
            "plain_ms_per_step": round(p * 1e3, 4), "gossamer_ms_per_step": round(g * 1e3, 4),
            "ratio": round(g / p, 3), "target": "<= 1.5",
            "bytes_per_step": ours[0][1] // args.steps,
        })
        print(rows[-1], flush=True)
    write_report("overhead", rows, "digits MLP (64-128-128-10, 26k params), 1 worker + 1 shard process, "
                 f"median of {args.repeats}, torch threads = 1, loopback ZMQ")


if __name__ == "__main__":
    main()
