"""The mode table: everything that differs between training modes, in one place (importable without torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["BARRIER_CONSISTENCY", "MODES", "OUTER_STEPS", "SHARD_CONSISTENCIES", "Mode", "mode_names", "mode_of", "resolve", "rows"]


class _HasMode(Protocol):
    @property
    def mode(self) -> str: ...

    @property
    def outer_step(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class Mode:
    """One way to train across nodes; a row of the table below.

    A mode with an outer step (diloco) has one row per outer step; `mode_of` picks it.
    """

    #: The value of `Experiment.mode`.
    name: str
    #: The value of `Experiment.outer_step` this row is for ("" when the mode has none).
    outer_step: str = ""
    #: One line for docs and `--help`.
    summary: str
    #: Parameter servers hold the model (False: workers average among themselves).
    servers: bool = True
    #: What the shards enforce: "sync" (a barrier over the current workers each version) or
    #: "async" (applied on arrival, bounded by `staleness`); "" without servers.
    shard_consistency: str = "async"
    #: Workers pass the experiment's `staleness` to the shards (diloco's rounds have their own rule).
    staleness_applies: bool = True
    #: A shard version is an outer round of `inner_steps` worker steps, not one step.
    rounds: bool = False
    #: "module:Class" of the trainer gossamer's built-in loop runs where `train_path.old_path_reason` says it
    #: keeps its mode's own (imported lazily: it needs torch).
    trainer: str
    #: "module:Class" of the mode's unit around a train function: it wraps the user's model and optimizer, and
    #: its `user_step` is the mode's exchange (`training.train_function.function_trainer`).
    function_trainer: str
    #: `compression = "auto"` and `optimizer = "auto"` resolve to these.
    default_compression: str = "none"
    default_optimizer: str = "sgd"
    #: Updates may be exchanged while the next step computes (`overlap`).
    allows_overlap: bool = False
    #: `global_batch_size` applies (the global batch of a step is fixed across worker counts).
    allows_global_batch: bool = False
    #: Nodes exchange parameter values, so only codecs that can carry values apply.
    exchanges_values: bool = False
    #: The shards apply the outer optimizer with `outer_lr`/`outer_momentum`, not the experiment's.
    outer_optimizer: bool = False
    #: Workers step a torch.optim optimizer of their own (building one imports torch's dynamo: 1.7 s).
    worker_optimizer: bool = False

    @property
    def barrier(self) -> bool:
        """Every current worker's update is waited for before the next version."""
        return self.servers and self.shard_consistency == "sync"

    @property
    def gossips(self) -> bool:
        """Workers average among themselves over a graph (`topology`)."""
        return not self.servers

    @property
    def lag_bounded(self) -> bool:
        """A node waits for in-neighbours left behind (`gossip_lag`): gossip of every step, not of rounds."""
        return not self.servers and not self.rounds

    @property
    def holds_round_start(self) -> bool:
        """The shards keep a round's start until its barrier, so workers may pull it again (`round_start`)."""
        return self.rounds and self.barrier

    @property
    def label(self) -> str:
        return f"{self.name}/{self.outer_step}" if self.outer_step else self.name

    @property
    def parallelisms(self) -> tuple[str, ...]:
        """Layouts inside a node this mode runs with (gossip mixes a whole replica per rank)."""
        return ("ddp", "fsdp", "pipeline") if self.servers else ("ddp",)


_PS_TRAINER = "gossamer.training.shards.ps_trainer:ParameterServerTrainer"
_GOSSIP_TRAINER = "gossamer.training.gossip.gossip_trainer:GossipTrainer"
_DILOCO_TRAINER = "gossamer.training.diloco.diloco_trainer:DilocoTrainer"
_SYNC_UNIT = "gossamer.training.sync.sync_function:SyncFunctionTrainer"
_ASYNC_UNIT = "gossamer.training.asynchronous.async_function:AsyncFunctionTrainer"
_GOSSIP_UNIT = "gossamer.training.gossip.gossip_function:GossipFunctionTrainer"
_DILOCO_UNIT = "gossamer.training.diloco.diloco_function:DilocoFunctionTrainer"

_TABLE: tuple[Mode, ...] = (
    Mode(name="sync", summary="parameter servers, every worker's gradient each step (BSP)",
         shard_consistency="sync", trainer=_PS_TRAINER, function_trainer=_SYNC_UNIT, allows_global_batch=True),
    Mode(name="async", summary="parameter servers, push gradient / pull parameters (SSP with `staleness`)",
         trainer=_PS_TRAINER, function_trainer=_ASYNC_UNIT, allows_overlap=True),
    Mode(name="gossip", summary="no servers: push-sum (SGP) averaging over a time-varying graph",
         servers=False, shard_consistency="", staleness_applies=False, trainer=_GOSSIP_TRAINER,
         function_trainer=_GOSSIP_UNIT, allows_overlap=True, exchanges_values=True, worker_optimizer=True),
    Mode(name="diloco", outer_step="sync", summary="H local steps, outer Nesterov on the servers, a barrier per round",
         shard_consistency="sync", staleness_applies=False, rounds=True, trainer=_DILOCO_TRAINER,
         function_trainer=_DILOCO_UNIT,
         default_compression="int8", default_optimizer="adamw", outer_optimizer=True,
         worker_optimizer=True),
    Mode(name="diloco", outer_step="async", summary="H local steps, outer step applied on arrival on the servers",
         staleness_applies=False, rounds=True, trainer=_DILOCO_TRAINER, function_trainer=_DILOCO_UNIT,
         default_compression="int8", default_optimizer="adamw", outer_optimizer=True,
         worker_optimizer=True),
    Mode(name="diloco", outer_step="gossip", summary="H local steps, outer average by gossip (no servers)",
         servers=False, shard_consistency="", staleness_applies=False, rounds=True, trainer=_GOSSIP_TRAINER,
         function_trainer=_GOSSIP_UNIT,
         default_compression="int8", default_optimizer="adamw", exchanges_values=True, worker_optimizer=True),
)

#: Every value of `Experiment.mode`, in table order.
MODES: tuple[str, ...] = tuple(dict.fromkeys(m.name for m in _TABLE))
#: Every value of `Experiment.outer_step`.
#: The gossip topologies a user may name; training/gossip/topology.py has one function per name.
TOPOLOGIES: tuple[str, ...] = ("exponential", "ring", "random")

OUTER_STEPS: tuple[str, ...] = tuple(m.outer_step for m in _TABLE if m.outer_step)


def mode_names() -> tuple[str, ...]:
    return MODES


def rows() -> tuple[Mode, ...]:
    """Every row of the table, in order (one per outer step for a mode with outer steps)."""
    return _TABLE


def resolve(mode: str, outer_step: str = "") -> Mode:
    """The table row for `mode` (and, for a mode with outer steps, `outer_step`).

    Raises:
        KeyError: no such mode or outer step (Experiment validation names the field first).
    """
    rows = [m for m in _TABLE if m.name == mode]
    if not rows:
        raise KeyError(mode)
    if len(rows) == 1:
        return rows[0]
    for m in rows:
        if m.outer_step == outer_step:
            return m
    raise KeyError(f"{mode}/{outer_step}")


def mode_of(exp: _HasMode) -> Mode:
    """The table row an experiment (or anything with `mode` and `outer_step`) runs by."""
    return resolve(exp.mode, exp.outer_step)


#: Every shard consistency a mode with servers runs its shards with (`ShardConfig.mode`).
SHARD_CONSISTENCIES: tuple[str, ...] = tuple(dict.fromkeys(m.shard_consistency for m in _TABLE if m.servers))
#: The shard consistency with a barrier: every current worker's update each version.
BARRIER_CONSISTENCY = "sync"
