"""Where a training rank sits (RankContext) and what it counts, shared by every mode's trainer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gossamer.core.experiment import Experiment
from gossamer.transport.throttle import TokenBucket

__all__ = ["Hook", "RankContext", "StepAbandoned", "StepStats"]

#: Receives (step, metric values) from a trainer.
Hook = Callable[[int, dict[str, float]], None]


@dataclass
class RankContext:
    """Where this rank sits: experiment, worker index, local rank, shard endpoints, lead flag."""

    experiment_id: str
    experiment: Experiment
    node_id: str
    worker_index: int
    num_workers: int
    endpoints: dict[int, str]
    checkpoint_dir: str
    lead: bool = False
    local_rank: int = 0
    local_world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step_delay_s: float = 0.0  # injected slowness (GOSSAMER_FAULT=delay:...), for tests
    throttle: TokenBucket | None = None  # emulated slow link (GOSSAMER_FAULT=bandwidth:...)
    worker_rank: int = -1  # position among the current workers (sync batch split); -1: worker_index
    generation: int = 0  # the experiment's membership generation this rank last heard of
    node_name: str = ""  # the node's name (profile directories, `profile_nodes`); "" = node_id
    host: str = "127.0.0.1"  # the address this node's data-plane servers bind (a gossip peer's)
    peers: dict[int, str] = field(default_factory=dict)  # gossip: the peers the assignment named at start
    #: A coordinator may name this rank lead later (a role process): past the last step it stays
    #: until the run completes. False (a trainer driven in-process): done means done.
    coordinated: bool = False
    #: The proof of this worker's sender id the coordinator handed it ("": shards do not check).
    sender_token: str = ""
    #: Shard index -> fencing epoch the coordinator last named (older replies are ignored).
    shard_epochs: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.worker_rank < 0:
            self.worker_rank = self.worker_index


@dataclass
class StepStats:
    steps: int = 0
    samples: int = 0
    loss: float = float("nan")
    version: int = 0
    samples_per_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0


class StepAbandoned(Exception):
    """A stop was requested while waiting on the shards: the step is given up."""
