"""Parameter server: shard plan, shard server, client (push/pull), consistency, optimizers."""

from __future__ import annotations

from gossamer.engine.shard_plan import (
    Chunk,
    ShardPlan,
    flatten_grads,
    flatten_params,
    take_shard_values,
    unflatten_into,
)
from gossamer.paramserver.consistency import ApplyRecord, SSPGate, lr_factor
from gossamer.paramserver.optimizer import OptimizerConfig, build_optimizer
from gossamer.paramserver.shard import Rebuilt, ShardConfig, ShardServer
from gossamer.paramserver.shard_client import PullResult, ShardClient

__all__ = [
    "ApplyRecord",
    "Chunk",
    "OptimizerConfig",
    "PullResult",
    "Rebuilt",
    "SSPGate",
    "ShardClient",
    "ShardConfig",
    "ShardPlan",
    "ShardServer",
    "build_optimizer",
    "flatten_grads",
    "flatten_params",
    "lr_factor",
    "take_shard_values",
    "unflatten_into",
]
