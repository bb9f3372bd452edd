"""A worker's own optimizer (DiLoCo's inner steps, gossip's local steps) and the experiment's lr schedule on it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gossamer.core.experiment import Experiment
from gossamer.core.lr_schedule import lr_multiplier
from gossamer.paramserver.optimizer import OptimizerConfig, build_optimizer, set_lr_factor

__all__ = ["inner_optimizer", "schedule_lr"]


def schedule_lr(opt: torch.optim.Optimizer, exp: Experiment, step: int) -> None:
    """The experiment's lr schedule on a worker's own optimizer, for its 0-based `step`."""
    set_lr_factor(opt, exp.lr, exp.linear_lr_factor()
                  * lr_multiplier(step, exp.total_steps, exp.lr_schedule, exp.warmup_steps))


def inner_optimizer(exp: Experiment, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The worker's own optimizer for the inner steps (`optimizer`, `lr`, ... of the experiment)."""
    return build_optimizer(
        OptimizerConfig(name=exp.optimizer, lr=exp.lr, momentum=exp.momentum, nesterov=exp.nesterov,
                        weight_decay=exp.weight_decay, **exp.optimizer_settings()),
        list(params),
    )
