"""A straggler for bench/wan.py: the digits MLP whose training forward and backward take FACTOR times as long.

The model path `_straggler:mlp` (bench/ on PYTHONPATH) builds the same network as
`gossamer.examples.digits:mlp` (same layers, same parameter names, same initialisation under the
same seed), so every host of a run uses it; only a process whose environment has
``WAN_SLOWDOWN=F`` (F > 1) is slowed. Such a process sleeps ``(F - 1)`` times its own measured
compute: after each training forward, ``(F - 1) x`` that forward's time; at the start of each
backward, ``(F - 1) x`` the previous backward's time (the first backward is not padded). The
host's compute then takes F times what it takes on this machine at that moment, contention
included, while the padding holds no core: a host that is slower, not one that takes CPU from
the other three (which a cgroup quota or busy-looping would, on a 2-core machine shared by all
four hosts). Evaluation (no_grad or eval mode) and the optimizer step are not padded.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from gossamer.examples.digits import mlp as _plain_mlp

ENV = "WAN_SLOWDOWN"


class SlowSequential(nn.Sequential):
    """`nn.Sequential` that pads its training forward/backward to `factor` x their measured time."""

    def __init__(self, layers: nn.Sequential, factor: float) -> None:
        super().__init__(*layers)
        self.factor = factor
        self.compute_s = 0.0  # measured forward + backward time (padded ones only)
        self.padded_s = 0.0  # sleep asked for
        self._bwd_start: float | None = None
        self._last_bwd = 0.0

    def _pad(self, seconds: float) -> None:
        pad = (self.factor - 1.0) * seconds
        if pad > 0:
            self.padded_s += pad
            time.sleep(pad)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        self._pad(self._last_bwd)
        self._bwd_start = time.perf_counter()

    def _backward_ends(self, grad: torch.Tensor) -> None:
        if self._bwd_start is not None:
            self._last_bwd = time.perf_counter() - self._bwd_start
            self.compute_s += self._last_bwd
            self._bwd_start = None

    def forward(self, x: Any) -> Any:
        if self.factor <= 1.0 or not self.training or not torch.is_grad_enabled():
            return super().forward(x)
        # The input's gradient is the last thing backward computes: its hook marks the end.
        x = x.detach().requires_grad_(True)
        x.register_hook(self._backward_ends)
        t = time.perf_counter()
        out = super().forward(x)
        dt = time.perf_counter() - t
        self.compute_s += dt
        self._pad(dt)
        out.register_hook(self._backward_begins)
        return out


def slowdown() -> float:
    """This process's compute slowdown factor (1.0: none)."""
    return max(1.0, float(os.environ.get(ENV, "1") or 1))


def mlp(hidden: int = 128, depth: int = 2, factor: float | None = None) -> nn.Module:
    """The digits MLP, slowed by `factor` (default: $WAN_SLOWDOWN) in training."""
    return SlowSequential(_plain_mlp(hidden, depth), slowdown() if factor is None else factor)
