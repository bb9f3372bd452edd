"""Step time of 1 worker + 1 parameter-server shard on the digits MLP vs a plain PyTorch loop, same run.

    python -m bench.overhead [--steps 2000] [--batch 32] [--repeats 3]

Rows `train:MODE` time a train function (bench/_train_loop.py: the user's own AdamW loop) through
the mode's unit (`Mode.function_trainer`) against the same function run in one plain process
(`gossamer.run_local`), every mode. Gossip has no shards: its row is two worker processes mixing with
each other each step (push-sum, no codec), the lead's time per step; the others are one worker and one
shard process.

Writes bench/results/overhead.{json,md}. Target: gossamer / plain <= 1.5.

The same run also measures the floor any exchange over ZMQ has here: a raw DEALER/ROUTER round trip
between two processes on loopback, carrying a step's bytes each way (the push up, the values down) and
nothing else (no framing, no apply), once per step. `floor_ratio` = (plain + raw round trip) / plain is
the best ratio a step that waits for its exchange can reach on this machine; `over_floor` = gossamer /
(plain + raw round trip) is what gossamer adds beyond it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.nn.functional as F

from bench._report import write_report
from bench._wait import reap
from gossamer.core.experiment import Experiment
from gossamer.engine import sampler
from gossamer.engine.model import build
from gossamer.engine.rank import RankContext
from gossamer.training.shards.ps_trainer import ParameterServerTrainer
from gossamer.training.train_function import run_local, run_train_function


def _exp(steps: int, batch: int, mode: str) -> Experiment:
    overlap = mode.endswith("async+overlap")
    if mode == "train:gossip":
        return Experiment(name="overhead", train="bench._train_loop:train", mode="gossip", num_ps_shards=0,
                          min_workers=2, batch_size=batch, total_steps=steps)
    if mode.startswith("train:"):
        return Experiment(name="overhead", train="bench._train_loop:train",
                          mode="async" if overlap else mode.removeprefix("train:"), overlap=overlap,
                          batch_size=batch, num_ps_shards=1, total_steps=steps)
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
    if exp.train:  # as a train function's shard host: the model from the function, the config from the experiment
        from gossamer.training.train_function import capture_model

        model = capture_model(exp)
        config = ShardConfig.for_experiment(exp, "bench", 0)
    else:
        model, _, _ = build(exp, torch.device("cpu"))
        config = ShardConfig(experiment="bench", shard=0, mode=exp.mode, staleness=None, total_steps=exp.total_steps,
                             optimizer=OptimizerConfig(name="sgd", lr=exp.lr, momentum=exp.momentum))
    plan = ShardPlan.for_experiment(model, exp)
    flat = flatten_params(model)
    srv = ShardServer(config, plan, {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone()
                                     for c in plan.chunks})
    q.put(srv.bind())
    ev = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), ev.set()), daemon=True).start()
    srv.serve(ev)  # in the main thread, as the parameter-server role runs it
    srv.close()


def _raw_echo(q: mp.Queue, down_bytes: int) -> None:  # type: ignore[type-arg]
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    reply = bytes(down_bytes)
    while True:
        identity, msg = sock.recv_multipart(copy=False)
        if len(msg) == 0:
            break
        sock.send_multipart([identity, reply])
    sock.close(linger=0)
    ctx.term()


def raw_round_trip(steps: int, up_bytes: int, down_bytes: int) -> float:
    """Seconds per raw ZMQ round trip of `up_bytes` out and `down_bytes` back, to another process on loopback."""
    import zmq

    ctx_mp = mp.get_context("spawn")
    q: mp.Queue = ctx_mp.Queue()  # type: ignore[type-arg]
    proc = ctx_mp.Process(target=_raw_echo, args=(q, down_bytes))
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{q.get(timeout=60)}")
        push = bytes(up_bytes)
        for _ in range(20):  # connection and first allocations
            sock.send(push)
            sock.recv(copy=False)
        t0 = time.perf_counter()
        for _ in range(steps):
            sock.send(push)
            sock.recv(copy=False)
        return (time.perf_counter() - t0) / steps
    finally:
        sock.send(b"")
        sock.close(linger=1000)
        ctx.term()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def plain_loop(exp: Experiment) -> float:
    """Seconds per step of the same model, data order and optimizer, in one process."""
    if exp.train:
        t0 = time.perf_counter()
        run_local(exp)
        return (time.perf_counter() - t0) / exp.total_steps
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
        rank = RankContext(experiment_id="bench", experiment=exp, node_id="n", worker_index=0, num_workers=1,
                           endpoints={0: endpoint}, checkpoint_dir="/tmp")
        t0 = time.perf_counter()
        if exp.train:
            def nothing(*_: object) -> None:
                return None

            trainer: ParameterServerTrainer = run_train_function(
                rank, on_metrics=nothing, updates=lambda: None, should_stop=lambda: False, on_saved=nothing,
                report_final=nothing)
        else:
            trainer = ParameterServerTrainer(rank)
            trainer.run()
        per_step = (time.perf_counter() - t0) / exp.total_steps
        return per_step, trainer.client.bytes_up + trainer.client.bytes_down
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _gossip_worker(exp_json: str, index: int, out: Any, peers_in: Any, done: Any, checkpoints: str) -> None:
    """One gossip worker of `gossip_loop`: its endpoint out, both peers' in, then the train function; its seconds
    per step and bytes out (the lead: once the final average is taken; the other serves until `done`)."""
    from gossamer.core.protocol import AssignmentUpdate

    torch.set_num_threads(1)
    exp = Experiment.from_json(exp_json)
    rank = RankContext(experiment_id="bench", experiment=exp, node_id=f"n{index}", worker_index=index, num_workers=2,
                       endpoints={}, checkpoint_dir=checkpoints, lead=index == 0, generation=1)
    told: list[bool] = []

    def updates() -> AssignmentUpdate | None:
        if told or peers_in.empty():
            return None
        told.append(True)
        return AssignmentUpdate(lead=index == 0, num_workers=2, generation=1, worker_rank=index, peers=peers_in.get())

    def nothing(*_: object) -> None:
        return None

    t0 = time.perf_counter()
    trainer = run_train_function(rank, on_metrics=nothing, updates=updates, should_stop=done.is_set,
                                 on_saved=nothing, report_final=nothing, serving=lambda ep: out.put((index, ep)))
    peer = getattr(trainer, "peer", None)
    moved = peer.bytes_up + peer.bytes_down if peer is not None else 0
    out.put(("done", index, (time.perf_counter() - t0) / exp.total_steps, moved))


def gossip_loop(exp: Experiment) -> tuple[float, int]:
    """Seconds per step of the lead of two gossip workers in two processes, and the bytes each step moved."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    inboxes = [ctx.Queue() for _ in range(2)]
    done = ctx.Event()
    with TemporaryDirectory() as checkpoints:
        procs = [ctx.Process(target=_gossip_worker, args=(exp.to_json(), i, out, inboxes[i], done, checkpoints))
                 for i in range(2)]
        for p in procs:
            p.start()
        try:
            peers = dict(out.get(timeout=120) for _ in range(2))
            for q in inboxes:
                q.put(peers)
            _, _, per_step, moved = out.get(timeout=600)  # the lead's: it ends once the average is taken
            done.set()
            return per_step, moved
        finally:
            done.set()
            reap(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mode in ("async", "async+overlap", "sync", "train:async", "train:async+overlap", "train:sync", "train:diloco",
                 "train:gossip"):
        exp = _exp(args.steps, args.batch, mode)
        plain = [plain_loop(exp) for _ in range(args.repeats)]
        ours = [(gossip_loop if mode == "train:gossip" else gossamer_loop)(exp) for _ in range(args.repeats)]
        per_way = ours[0][1] // args.steps // 2  # a step's bytes, about half each way
        raw = [raw_round_trip(args.steps, per_way, per_way) for _ in range(args.repeats)]
        p, g, r = statistics.median(plain), statistics.median(t for t, _ in ours), statistics.median(raw)
        rows.append({
            "mode": mode, "batch": args.batch, "steps": args.steps,
            "plain_ms_per_step": round(p * 1e3, 4), "gossamer_ms_per_step": round(g * 1e3, 4),
            "ratio": round(g / p, 3), "target": "<= 1.5",
            "raw_zmq_rtt_ms": round(r * 1e3, 4), "floor_ratio": round((p + r) / p, 3),
            "over_floor": round(g / (p + r), 3),
            "bytes_per_step": ours[0][1] // args.steps,
            "load_1min": round(os.getloadavg()[0], 2),
        })
        print(rows[-1], flush=True)
    write_report("overhead", rows, "digits MLP (64-128-128-10, 26k params), 1 worker + 1 shard process "
                 "(train:gossip: 2 worker processes, the lead's step), "
                 f"median of {args.repeats}, torch threads = 1, loopback ZMQ; raw_zmq_rtt_ms: a DEALER/ROUTER "
                 "round trip of the step's bytes between two processes, no framing or apply (the floor of a "
                 "step that waits for its exchange: floor_ratio = (plain + rtt) / plain; async+overlap hides it)")


if __name__ == "__main__":
    main()
