"""Step time of a train function through each mode against the same loop in one plain process, same run.

    python -m bench.overhead [--models digits,100m] [--steps N] [--repeats N] [--modes train:async,...]
                             [--label LABEL]

Rows `train:MODE` time a train function (bench/_train_loop.py: the user's own AdamW loop) through the
mode's unit (`Mode.function_trainer`) against the same function run in one plain process
(`gossamer.run_local`), every mode; rows `async`, `async+overlap`, `sync` time gossamer's built-in loop
(the digits model only). One worker and one shard process, except gossip, which has no shards: two worker
processes mixing with each other each step (push-sum, no codec), the lead's time per step.

`digits`: the digits MLP (26k parameters), 2000 steps, median of 3. `100m`: an MLP of 104.9M parameters on
random data (`bench._train_loop:train_100m`), 6 steps each timed on its own, the median of all but the first
(the model's construction, the first pull and the optimizer's first step left out), one run; no diloco row
there (it exchanges once every `inner_steps` = 20 steps, and a round costs what an async exchange does).
The whole run takes about 10 minutes on a 2-core machine.

Writes bench/results/overhead.{json,md} (a --label run: bench/out/). Targets: gossamer / plain <= 1.5 at the
digits model, <= 1.1 at 100M.

The same run also measures the floor any exchange over ZMQ has here: a raw DEALER/ROUTER round trip
between two processes on loopback, carrying a step's bytes each way (the push up, the values down) and
nothing else (no framing, no apply), once per step. `floor_ratio` = (plain + raw round trip) / plain is
the best ratio a step that waits for its exchange can reach on this machine; `over_floor` = gossamer /
(plain + raw round trip) is what gossamer adds beyond it.

Where the time goes, per step over the whole run: CPU ms of the plain process, of the worker process (its
threads, ZMQ's I/O thread among them) and of the shard process (on a loaded machine the wall times measure
the scheduler as much as the step, the CPU seconds the work each side does); the worker's wait for its
exchanges (`exchange_ms`: push sent to reply read, the shard's work in it) and its encoding and decoding
(`codec_ms`).
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

from bench import _train_loop
from bench._report import write_report
from bench._wait import reap
from gossamer.core.experiment import Experiment
from gossamer.engine import sampler
from gossamer.engine.model import build
from gossamer.engine.rank import RankContext
from gossamer.training.shards.ps_trainer import ParameterServerTrainer
from gossamer.training.train_function import run_local, run_train_function

#: The rows of each model: the built-in loop's modes, then the train function's.
MODES = {
    "digits": ("async", "async+overlap", "sync", "train:async", "train:async+overlap", "train:sync", "train:diloco",
               "train:gossip"),
    "100m": ("train:async", "train:async+overlap", "train:sync", "train:gossip"),
}


def _exp(steps: int, batch: int, mode: str, model: str = "digits") -> Experiment:
    overlap = mode.endswith("async+overlap")
    fn = "bench._train_loop:train_100m" if model == "100m" else "bench._train_loop:train"
    if mode == "train:gossip":
        return Experiment(name="overhead", train=fn, mode="gossip", num_ps_shards=0, min_workers=2,
                          batch_size=batch, total_steps=steps)
    if mode.startswith("train:"):
        return Experiment(name="overhead", train=fn,
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
    cpu0 = time.process_time()
    ev = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), ev.set()), daemon=True).start()
    srv.serve(ev)  # in the main thread, as the parameter-server role runs it
    q.put(time.process_time() - cpu0)  # the shard's CPU seconds while it served
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


def raw_round_trip(steps: int, up_bytes: int, down_bytes: int, warmup: int = 20) -> float:
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
        for _ in range(warmup):  # connection and first allocations
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


def _per_step(exp: Experiment, total_s: float) -> float:
    """Seconds per step: of the whole run, or (`train_100m`) the median step but the first."""
    if exp.train.endswith(":train_100m"):
        stamps = _train_loop.STEP_TIMES
        return statistics.median(b - a for a, b in zip(stamps[1:-1], stamps[2:], strict=True))
    return total_s / exp.total_steps


def plain_loop(exp: Experiment) -> tuple[float, float]:
    """Seconds per step of the same model, data order and optimizer in one process, and its CPU seconds per step
    over the whole run."""
    if exp.train:
        t0, cpu0 = time.perf_counter(), time.process_time()
        run_local(exp)
        return _per_step(exp, time.perf_counter() - t0), (time.process_time() - cpu0) / exp.total_steps
    model, train, _ = build(exp, torch.device("cpu"))
    x_all, y_all = train.tensors
    opt = torch.optim.SGD(model.parameters(), lr=exp.lr, momentum=exp.momentum)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for step in range(exp.total_steps):
        idx = sampler.async_batch(len(train), exp.batch_size, step, exp.seed, 0)
        opt.zero_grad()
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        opt.step()
    return (time.perf_counter() - t0) / exp.total_steps, (time.process_time() - cpu0) / exp.total_steps


def _nothing(*_: object) -> None:
    return None


def gossamer_loop(exp: Experiment) -> dict[str, float]:
    """One worker pushing to / pulling from one shard in another process: seconds per step (`per_step`), `bytes`,
    and per step over the whole run: CPU seconds of the worker and of the shard process, and the worker's seconds
    waiting for its exchanges (`exchange`: sent to answered, the shard's work in it) and encoding and decoding
    them (`codec`)."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    stop = ctx.Event()
    proc = ctx.Process(target=_serve, args=(exp.to_json(), q, stop))
    proc.start()
    try:
        endpoint = q.get(timeout=600)  # a 100M model is built there first
        rank = RankContext(experiment_id="bench", experiment=exp, node_id="n", worker_index=0, num_workers=1,
                           endpoints={0: endpoint}, checkpoint_dir="/tmp")
        t0, cpu0 = time.perf_counter(), time.process_time()
        trainer: Any
        if exp.train:
            trainer = run_train_function(rank, on_metrics=_nothing, updates=lambda: None, should_stop=lambda: False,
                                         on_saved=_nothing, report_final=_nothing)
        else:
            trainer = ParameterServerTrainer(rank)
            trainer.run()
        n = exp.total_steps
        run = {"per_step": _per_step(exp, time.perf_counter() - t0), "worker_cpu": (time.process_time() - cpu0) / n,
               "bytes": float(trainer.client.bytes_up + trainer.client.bytes_down),
               "exchange": trainer.exchange_s / n, "codec": (trainer.client.encode_s + trainer.client.decode_s) / n}
        stop.set()
        run["shard_cpu"] = q.get(timeout=60) / n
        return run
    finally:
        stop.set()
        reap([proc], 10)


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

    t0, cpu0 = time.perf_counter(), time.process_time()
    trainer = run_train_function(rank, on_metrics=_nothing, updates=updates, should_stop=done.is_set,
                                 on_saved=_nothing, report_final=_nothing, serving=lambda ep: out.put((index, ep)))
    peer = getattr(trainer, "peer", None)
    n = exp.total_steps
    out.put(("done", index, {"per_step": _per_step(exp, time.perf_counter() - t0),
                             "worker_cpu": (time.process_time() - cpu0) / n,
                             "bytes": float(peer.bytes_up + peer.bytes_down if peer is not None else 0),
                             "exchange": 0.0, "codec": 0.0, "shard_cpu": 0.0}))  # gossip: CPU and bytes only


def gossip_loop(exp: Experiment) -> dict[str, float]:
    """`gossamer_loop`'s figures for the lead of two gossip workers in two processes (no shard: its CPU is 0)."""
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
            _, _, run = out.get(timeout=1200)  # the lead's: it ends once the average is taken
            done.set()
            return run  # type: ignore[no-any-return]
        finally:
            done.set()
            reap(procs)


def measure(model: str, mode: str, steps: int, batch: int, repeats: int) -> dict[str, Any]:
    """One row: the plain loop and gossamer's in turn `repeats` times (a load that comes and goes weighs on both
    alike), the raw round trip of the same bytes, medians."""
    big = model == "100m"
    exp = _exp(steps, batch, mode, model)
    plain, ours = [], []
    for _ in range(repeats):
        plain.append(plain_loop(exp))
        ours.append((gossip_loop if mode == "train:gossip" else gossamer_loop)(exp))
    per_way = int(ours[0]["bytes"]) // steps // 2  # a step's bytes, about half each way
    raw = [raw_round_trip(2 if big else steps, per_way, per_way, warmup=1 if big else 20) for _ in range(repeats)]
    p, g, r = statistics.median(t for t, _ in plain), statistics.median(o["per_step"] for o in ours), statistics.median(raw)
    return {
        "model": model, "mode": mode, "batch": batch, "steps": steps,
        "plain_ms_per_step": round(p * 1e3, 4), "gossamer_ms_per_step": round(g * 1e3, 4),
        "ratio": round(g / p, 3), "target": "<= 1.1" if big else "<= 1.5",
        "raw_zmq_rtt_ms": round(r * 1e3, 4), "floor_ratio": round((p + r) / p, 3), "over_floor": round(g / (p + r), 3),
        "plain_cpu_ms": round(statistics.median(c for _, c in plain) * 1e3, 4),
        **{f"{k}_ms": round(statistics.median(o[k] for o in ours) * 1e3, 4)
           for k in ("worker_cpu", "shard_cpu", "exchange", "codec")},
        "bytes_per_step": int(ours[0]["bytes"]) // steps,
        "load_1min": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="digits,100m", help="digits, 100m or both")
    ap.add_argument("--steps", type=int, default=None, help="default: 2000 (digits), 6 (100m)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None, help="default: 3 (digits), 1 (100m)")
    ap.add_argument("--modes", default=None, help="comma-separated rows (default: all of each model's)")
    ap.add_argument("--label", default=None, help="a labelled run: written to bench/out/overhead_<label>")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model in args.models.split(","):
        if model not in MODES:
            ap.error(f"--models: {model!r} is not one of {sorted(MODES)}")
        big = model == "100m"
        for mode in args.modes.split(",") if args.modes else MODES[model]:
            rows.append(measure(model, mode, args.steps or (6 if big else 2000), args.batch,
                                args.repeats or (1 if big else 3)))
            print(rows[-1], flush=True)
    write_report("overhead", rows,
                 "digits: the digits MLP (64-128-128-10, 26k params), median of 3 runs; 100m: an MLP 1024-4096x7-10 "
                 "(104.9M params) on random data, each step timed, the median of all but the first, one run, CPU "
                 "columns over the whole run (the model's construction and first pull included); 1 worker + 1 shard "
                 "process (train:gossip: 2 worker processes, the lead's step), torch threads = 1, loopback ZMQ; "
                 "raw_zmq_rtt_ms: a DEALER/ROUTER round trip of the step's bytes between two processes, no framing "
                 "or apply (the floor of a step that waits for its exchange: floor_ratio = (plain + rtt) / plain; "
                 "async+overlap hides it); *_cpu_ms: CPU ms per step of the plain process, the worker and the shard; "
                 "exchange_ms: the worker's wait for its exchanges (sent to answered), codec_ms: their encoding and "
                 "decoding, per step (gossip: not timed, 0)", label=args.label)


if __name__ == "__main__":
    main()
