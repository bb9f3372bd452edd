"""Test harness: real shard servers (ZMQ, loopback, port 0) for an Experiment, and the reference loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gossamer.core.experiment import Experiment
from gossamer.engine import sampler
from gossamer.engine.model import build
from gossamer.engine.shard_plan import flatten_params
from gossamer.paramserver.local import LocalShards

Shards = LocalShards


def reference_sync(exp: Experiment, global_batch: int) -> torch.Tensor:
    """Plain single-process PyTorch on the same global batches, same optimizer: the flat parameters."""
    torch.set_num_threads(1)
    model, train, _ = build(exp, torch.device("cpu"))
    x_all, y_all = train.tensors
    if exp.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=exp.lr, momentum=exp.momentum,
                                                     nesterov=exp.nesterov, weight_decay=exp.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=exp.lr, weight_decay=exp.weight_decay,
                                **exp.optimizer_settings())
    for step in range(exp.total_steps):
        idx = sampler.sync_global_batch(len(train), global_batch, step, exp.seed)
        opt.zero_grad()
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        opt.step()
    return flatten_params(model)


def run_trainers(exp: Experiment, endpoints: dict[int, str], workers: int, checkpoint_dir: str = "/tmp",
                 timeout: float = 600.0) -> list[object]:
    """`workers` trainers of `exp`'s mode, one thread each, against real shards at `endpoints`; the trainers.

    Raises what any trainer raised (the first), after every thread has ended or `timeout` s passed.
    """
    import threading

    from gossamer.engine.rank import RankContext
    from gossamer.training.diloco.diloco_trainer import DilocoTrainer
    from gossamer.training.shards.ps_trainer import ParameterServerTrainer

    cls = DilocoTrainer if exp.mode == "diloco" else ParameterServerTrainer
    trainers = [
        cls(RankContext(experiment_id="e", experiment=exp, node_id=f"node{w}", worker_index=w,
                        num_workers=workers, endpoints=endpoints, checkpoint_dir=checkpoint_dir))
        for w in range(workers)
    ]
    errors: list[BaseException] = []

    def run(t: ParameterServerTrainer) -> None:
        try:
            t.run()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not errors, errors
    return list(trainers)


def run_async(exp: Experiment, workers: int = 3) -> dict[str, object]:
    """Train `exp` with `workers` ParameterServerTrainer threads against real shards; final metrics and trainers."""
    from gossamer.engine.model import evaluate
    from gossamer.paramserver import unflatten_into

    torch.set_num_threads(1)
    shards = Shards(exp)
    try:
        trainers: list = run_trainers(exp, shards.endpoints, workers)
        flat = shards.flat()
        server_stats = [s.stats() for s in shards.servers]
    finally:
        shards.close()
    model = trainers[0].model
    unflatten_into(model, flat)
    acc, loss = evaluate(model, trainers[0].eval_set, torch.device("cpu"))
    return {
        "accuracy": acc, "loss": loss, "trainers": trainers, "server_stats": server_stats,
        "bytes_up": sum(t.client.bytes_up for t in trainers),
        "bytes_down": sum(t.client.bytes_down for t in trainers),
        "raw_bytes_up": sum(t.client.raw_bytes_up for t in trainers),
    }
