"""Mixed precision on a worker: which dtypes a device allows, and dynamic loss scaling for fp16."""

from __future__ import annotations

import torch

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment

__all__ = ["LossScaler", "check_precision"]


def check_precision(exp: Experiment, device: torch.device) -> None:
    """Refuse a precision this device cannot train in.

    Raises:
        ConfigError: fp16 off CUDA (CPU fp16 autocast is slow and has no loss-scaling story;
            bf16 has fp32's range and needs no scaling).
    """
    if exp.precision == "fp16" and device.type != "cuda":
        raise ConfigError("precision", f"fp16 needs a CUDA device (this rank runs on {device.type}); "
                                       "use precision='bf16' on CPU")


class LossScaler:
    """Dynamic loss scaling, as torch.amp.GradScaler does it, for gradients we apply elsewhere.

    GradScaler drives a local `optimizer.step()`; here the step happens on the parameter
    servers, so the worker scales the loss, unscales the gradient itself and skips the push
    when it overflowed. The scale halves on an overflow and doubles after
    `growth_interval` clean steps.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._clean = 0
        self.overflows = 0

    def update(self, finite: bool) -> bool:
        """Record whether this step's unscaled gradient was finite; returns it (False: skip the step)."""
        if not finite:
            self.scale = max(1.0, self.scale * self.backoff_factor)
            self._clean = 0
            self.overflows += 1
            return False
        self._clean += 1
        if self._clean >= self.growth_interval:
            self.scale *= self.growth_factor
            self._clean = 0
        return True
