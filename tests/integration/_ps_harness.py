"""Test harness: real shard servers (ZMQ, loopback, port 0) for an Experiment, and the reference loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gossamer.experiment import Experiment
from gossamer.paramserver import (
    OptimizerConfig,
    ShardClient,
    ShardConfig,
    ShardPlan,
    ShardServer,
    flatten_params,
)
from gossamer.worker import sampler
from gossamer.worker.trainer import build


class Shards:
    """`exp.num_ps_shards` ShardServers in background threads, initialised like the PS role does."""

    def __init__(self, exp: Experiment, experiment_id: str = "e") -> None:
        model, _, _ = build(exp, torch.device("cpu"))
        self.plan = ShardPlan.for_module(model, exp.num_ps_shards, exp.chunk_numel)
        flat = flatten_params(model)
        self.servers: list[ShardServer] = []
        self.endpoints: dict[int, str] = {}
        for s in range(exp.num_ps_shards):
            init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone()
                    for c in self.plan.chunks_of_shard(s)}
            cfg = ShardConfig(
                experiment=experiment_id, shard=s, mode=exp.mode, staleness=exp.staleness,
                optimizer=OptimizerConfig(name=exp.optimizer, lr=exp.lr, momentum=exp.momentum,
                                          nesterov=exp.nesterov, weight_decay=exp.weight_decay),
                total_steps=exp.total_steps, lr_staleness_scaling=exp.lr_staleness_scaling,
            )
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            srv = ShardServer(cfg, self.plan, init, shapes=shapes)
            self.endpoints[s] = srv.bind()
            srv.start()
            self.servers.append(srv)
        self.experiment_id = experiment_id

    def flat(self) -> torch.Tensor:
        client = ShardClient(experiment=self.experiment_id, sender="reader", plan=self.plan, endpoints=self.endpoints)
        try:
            res = client.pull()
        finally:
            client.close()
        out = torch.zeros(self.plan.total_numel)
        self.plan.scatter(out, res.values)
        return out

    def close(self) -> None:
        for s in self.servers:
            s.close()


def reference_sync(exp: Experiment, global_batch: int) -> torch.Tensor:
    """Plain single-process PyTorch on the same global batches, same optimizer: the flat parameters."""
    torch.set_num_threads(1)
    model, train, _ = build(exp, torch.device("cpu"))
    x_all, y_all = train.tensors
    if exp.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=exp.lr, momentum=exp.momentum,
                                                     nesterov=exp.nesterov, weight_decay=exp.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=exp.lr, weight_decay=exp.weight_decay)
    for step in range(exp.total_steps):
        idx = sampler.sync_global_batch(len(train), global_batch, step, exp.seed)
        opt.zero_grad()
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        opt.step()
    return flatten_params(model)


def run_async(exp: Experiment, workers: int = 3, throttle_at: dict[int, object] | None = None) -> dict[str, object]:
    """Train `exp` with `workers` Trainer threads against real shards; final metrics and trainers."""
    import threading

    from gossamer.paramserver import unflatten_into
    from gossamer.worker.trainer import RankContext, Trainer, evaluate

    torch.set_num_threads(1)
    shards = Shards(exp)
    trainers = [
        Trainer(RankContext(experiment_id="e", experiment=exp, node_id=f"node{w}", worker_index=w,
                            num_workers=workers, endpoints=shards.endpoints, checkpoint_dir="/tmp"))
        for w in range(workers)
    ]
    errors: list[BaseException] = []

    def run(t: Trainer) -> None:
        try:
            t.run()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    try:
        assert not errors, errors
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
