"""Which loop an experiment runs: a train function (the user's, or gossamer's built-in one) or the older trainers."""

from __future__ import annotations

import dataclasses

from gossamer.core.experiment import BUILTIN_TRAIN, Experiment
from gossamer.core.modes import mode_of

__all__ = ["BUILTIN_TRAIN", "builtin_train_function", "old_path_reason", "shards_step_optimizer"]


def shards_step_optimizer(exp: Experiment) -> bool:
    """Whether the shards step the experiment's optimizer on the gradients the workers push: gossamer's built-in
    loop in async and sync (through its train function too), so the run keeps one momentum or Adam state on the
    shards (a worker that joins or replaces one takes the run's), its lr schedule and the staleness-aware lr.
    A user's train function steps its own optimizer on the worker: in async it pushes the change it made for the
    shards to add, in sync its gradients for their mean (any optimizer keeps its meaning there)."""
    row = mode_of(exp)
    return exp.train in ("", BUILTIN_TRAIN) and row.servers and not row.rounds


def old_path_reason(exp: Experiment, *, local_ranks: int = 1) -> str:
    """Why an experiment without `train` runs on its mode's own trainer (ps_trainer, diloco, gossip_loop) on a
    node of `local_ranks` ranks; empty where gossamer's built-in train function runs it, through the trainers a
    user's train function runs on (`training/builtin_train.py`).

    async and sync run on the one path: the built-in train function's step pushes its gradient and the shards
    step the experiment's optimizer on it, as the older trainer did (`shards_step_optimizer`); in sync, over a
    re-formed barrier or shards that moved on, it computes the step again (`StepRedo`).

    What the train-function trainers do not do yet, or do otherwise:
    - diloco: the built-in round keeps memory down (the inner step inside backward, the round's start folded
      with the codec's residual, exchanged shard by shard) and pushes the workers' mean pseudo-gradient.
    - fsdp and pipeline shard the model over a node's ranks, where a train function's units hold it whole on
      each; fp16 (loss scaling). Nodes of either path train together (in gossip they exchange parameters, in
      async and sync both push gradients to the same shards), so the choice is each node's.

    A node of several local ranks with `parallelism = "ddp"` runs the built-in train function: `batch_size`
    stays the node's, each rank taking its share of the node's batch (`builtin_train._want`).
    """
    if exp.train:
        return ""
    row = mode_of(exp)
    if row.rounds:
        return f"mode {row.label}: the built-in round's memory savings and the workers' mean pseudo-gradient"
    if exp.parallelism != "ddp":
        return f"parallelism {exp.parallelism!r}: the model sharded over the node's {local_ranks} local ranks"
    if exp.precision == "fp16":
        return "precision 'fp16': loss scaling is the built-in trainer's"
    return ""


def builtin_train_function(exp: Experiment, *, local_ranks: int = 1) -> Experiment:
    """`exp` as a node of `local_ranks` ranks runs it: without `train` and without an `old_path_reason`, with the
    built-in train function as its `train` (the node then runs what a user's train function runs)."""
    if exp.train or old_path_reason(exp, local_ranks=local_ranks):
        return exp
    return dataclasses.replace(exp, train=BUILTIN_TRAIN)
