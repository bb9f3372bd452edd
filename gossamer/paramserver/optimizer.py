"""The optimizer a shard server applies to its chunks: torch's own SGD / AdamW, configured."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from gossamer.errors import ConfigError
from gossamer.paramserver.delayed_nesterov import DelayedNesterov

__all__ = ["FOREACH_MAX_NUMEL", "OptimizerConfig", "build_optimizer", "set_lr_factor"]

logger = logging.getLogger(__name__)

_NAMES = ("sgd", "adamw")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Server-side optimizer settings (the same meaning as torch.optim's arguments)."""

    name: str
    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    #: SGD with momentum as Delayed Nesterov (`DelayedNesterov`): asynchronous DiLoCo's outer step.
    delayed: bool = False

    def __post_init__(self) -> None:
        if self.name not in _NAMES:
            raise ConfigError("name", f"must be one of {_NAMES}, got {self.name!r}")
        if not _finite_nonneg(self.lr) or self.lr == 0:
            raise ConfigError("lr", f"must be a finite positive number, got {self.lr!r}")
        if not _finite_nonneg(self.momentum) or self.momentum >= 1:
            raise ConfigError("momentum", f"must be in [0, 1), got {self.momentum!r}")
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ConfigError("nesterov", "needs name='sgd' and momentum > 0")
        if self.momentum and self.name != "sgd":
            raise ConfigError("momentum", "only applies to name='sgd' (use betas for adamw)")
        if self.delayed and (self.name != "sgd" or self.momentum == 0 or self.weight_decay):
            raise ConfigError("delayed", "needs name='sgd', momentum > 0 and no weight_decay")
        if not _finite_nonneg(self.weight_decay):
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        if (
            not isinstance(self.betas, tuple | list)
            or len(self.betas) != 2
            or not all(_finite_nonneg(b) and b < 1 for b in self.betas)
        ):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        if not _finite_nonneg(self.eps) or self.eps == 0:
            raise ConfigError("eps", f"must be a finite positive number, got {self.eps!r}")


def _finite_nonneg(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


#: Above this many values an optimizer steps tensor by tensor (`build_optimizer`).
FOREACH_MAX_NUMEL = 1 << 24


def build_optimizer(config: OptimizerConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """torch.optim.SGD or AdamW over `params`.

    Both are elementwise, so applying them per chunk gives exactly what one torch process
    applying them to the whole model would. Past `FOREACH_MAX_NUMEL` values the per-tensor
    implementation is used: the multi-tensor one makes its temporaries (AdamW's denominators,
    nesterov's or weight decay's adjusted gradients) for every tensor at once, one more copy
    of everything it steps (bench/scale_model.py), where per tensor they are one tensor's.
    """
    foreach = None if sum(p.numel() for p in params) <= FOREACH_MAX_NUMEL else False
    if config.delayed:
        return DelayedNesterov(params, lr=config.lr, momentum=config.momentum)
    if config.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            foreach=foreach,
        )
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(float(config.betas[0]), float(config.betas[1])),
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=foreach,
    )


def set_lr_factor(optimizer: torch.optim.Optimizer, base_lr: float, factor: float) -> None:
    """Set every param group's lr to `base_lr * factor` (used for staleness-aware lr)."""
    for group in optimizer.param_groups:
        group["lr"] = base_lr * factor
