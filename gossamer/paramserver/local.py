"""Parameter-server shards in this process (threads, real ZMQ on loopback): for tests, benchmarks, notebooks."""

from __future__ import annotations

import torch

from gossamer.core.experiment import Experiment
from gossamer.engine.shard_plan import ShardPlan, flatten_params
from gossamer.paramserver.shard import ShardConfig, ShardServer
from gossamer.paramserver.shard_client import ShardClient


class LocalShards:
    """`exp.num_ps_shards` ShardServers in background threads, initialised like the PS role does."""

    def __init__(self, exp: Experiment, experiment_id: str = "e") -> None:
        from gossamer.engine.model import build  # the worker package imports this one

        model, _, _ = build(exp, torch.device("cpu"))
        self.plan = ShardPlan.for_experiment(model, exp)
        flat = flatten_params(model)
        self.servers: list[ShardServer] = []
        self.endpoints: dict[int, str] = {}
        for s in range(exp.num_ps_shards):
            init = {
                c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone()
                for c in self.plan.chunks_of_shard(s)
            }
            cfg = ShardConfig.for_experiment(exp, experiment_id, s)
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            srv = ShardServer(cfg, self.plan, init, shapes=shapes)
            self.endpoints[s] = srv.bind()
            srv.start()
            self.servers.append(srv)
        self.experiment_id = experiment_id

    def flat(self) -> torch.Tensor:
        client = ShardClient(
            experiment=self.experiment_id, sender="reader", plan=self.plan, endpoints=self.endpoints
        )
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
