"""The optimizer a shard server applies to its chunks: torch's own SGD / AdamW, configured."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.sgd import sgd as sgd_per_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gossamer.core.errors import ConfigError
from gossamer.paramserver.delayed_nesterov import DelayedNesterov

__all__ = ["FOREACH_MAX_NUMEL", "FusedSGD", "OptimizerConfig", "build_optimizer", "set_lr_factor", "step"]

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
    There SGD with momentum is `FusedSGD`: the per-tensor bits in one pass over memory.
    """
    foreach = None if sum(p.numel() for p in params) <= FOREACH_MAX_NUMEL else False
    if config.delayed:
        return DelayedNesterov(params, lr=config.lr, momentum=config.momentum)
    if config.name == "sgd":
        sgd = FusedSGD if foreach is False and config.momentum and FusedSGD.supported(params) else torch.optim.SGD
        return sgd(
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


def step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`; torch's own SGD (`build_optimizer` for a small shard) through its functional form.

    `Optimizer.step`'s wrappers (profiler range, hooks, grad mode, the dynamo guard) and SGD's
    group set-up cost about 100 us a step here, most of a small model's update (bench/overhead.py);
    the functional form is what `SGD.step` itself calls with the same arguments, so the same bits,
    and a dispatch mode (`WritesAside`) sees the same writes. Anything else (hooks, a first step
    that creates the momentum buffers, options this path does not take) goes through `step()`.
    """
    if type(optimizer) is not torch.optim.SGD or not _plain_sgd(optimizer):
        optimizer.step()
        return
    stepping = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        bufs = ([optimizer.state[p].get("momentum_buffer") for p in params] if group["momentum"]
                else [None] * len(params))
        if group["momentum"] and any(b is None for b in bufs):
            optimizer.step()  # a first step creates the buffers (torch stores them in its state): every group, once
            return
        if params:
            stepping.append((group, params, bufs))
    with torch.no_grad():
        for group, params, bufs in stepping:
            sgd_per_tensor(params, [p.grad for p in params], bufs, foreach=False,
                           weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                           dampening=group["dampening"], nesterov=group["nesterov"], maximize=False)


def _plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """No hooks on `optimizer` or on every optimizer, and no option the functional path leaves out."""
    from torch.optim import optimizer as base

    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or base._global_optimizer_pre_hooks or base._global_optimizer_post_hooks):
        return False
    return all(not g.get("maximize") and not g.get("differentiable") and not g.get("fused") and not g.get("foreach")
               for g in optimizer.param_groups)


#: torch's fused CPU SGD kernel steps 64-byte units with its vector loop and only the values
#: after the last whole unit with its scalar loop, which rounds differently: so only a tensor's
#: last `numel % _FUSED_UNIT` values would differ from the per-tensor kernels.
_FUSED_UNIT = 16


class FusedSGD(torch.optim.SGD):
    """SGD with momentum in one pass over values, momentum and gradient: the same bits as
    `torch.optim.SGD(foreach=False)`, about 0.7x its time.

    The per-tensor SGD reads and writes the momentum buffer twice and the values once per
    step (``buf.mul_(m).add_(g)``, ``p.add_(buf, alpha=-lr)``); torch's fused kernel once. At
    52M values here: 54 ms against 70-77 ms a step. The fused kernel's scalar tail rounds
    differently from its vector loop (and from the per-tensor kernels, which are the same
    bits however a tensor is cut into chunks), so each tensor's whole 16-value units step
    fused and the rest (fewer than 16 values) per tensor: a shard steps exactly what one torch
    process stepping the whole model with per-tensor SGD would. The first step (no momentum
    buffer yet) and any step under a dispatch mode (`WritesAside`, which must see the writes
    to each whole tensor) take the per-tensor path.
    """

    @staticmethod
    def supported(params: list[torch.Tensor]) -> bool:
        """Whether this torch has the fused CPU kernel and `params` are all fp32 on the CPU."""
        return _fused_cpu_sgd() and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None or _get_current_dispatch_mode() is not None:
            return super().step(closure)
        for group in self.param_groups:
            if group["maximize"] or group["differentiable"]:
                return super().step()
            stepping = [p for p in group["params"] if p.grad is not None]
            if any("momentum_buffer" not in self.state[p] for p in stepping):
                return super().step()
        for group in self.param_groups:
            heads: list[list[Any]] = [[], [], []]  # values, gradients, momentum buffers
            tails: list[list[Any]] = [[], [], []]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p]["momentum_buffer"]
                flat_p, flat_g, flat_b = p.view(-1), p.grad.view(-1), buf.view(-1)
                cut = flat_p.numel() - flat_p.numel() % _FUSED_UNIT
                for out, t in zip(heads, (flat_p, flat_g, flat_b), strict=True):
                    out.append(t[:cut])
                if cut < flat_p.numel():
                    for out, t in zip(tails, (flat_p, flat_g, flat_b), strict=True):
                        out.append(t[cut:])
            kw = {"weight_decay": group["weight_decay"], "momentum": group["momentum"], "lr": group["lr"],
                  "dampening": group["dampening"], "nesterov": group["nesterov"], "maximize": False}
            if heads[0]:
                torch._fused_sgd_(heads[0], heads[1], heads[2], is_first_step=False, **kw)
            if tails[0]:
                sgd_per_tensor(tails[0], tails[1], tails[2], foreach=False, **kw)
        return None


@functools.cache
def _fused_cpu_sgd() -> bool:
    """Whether torch's fused SGD runs on the CPU here (torch 2.3, which the package allows, has the op
    for CUDA only): tried once on four values."""
    try:
        p, g, b = torch.ones(4), torch.ones(4), torch.ones(4)
        torch._fused_sgd_([p], [g], [b], weight_decay=0.0, momentum=0.5, lr=0.5, dampening=0.0, nesterov=False,
                          maximize=False, is_first_step=False)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(b, torch.full((4,), 1.5)) and torch.equal(p, torch.full((4,), 0.25)))
