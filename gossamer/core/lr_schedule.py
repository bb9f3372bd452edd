"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay (torch-free)."""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "lr_multiplier"]

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, total_steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """The factor on the base lr for the update that makes version `step` + 1 (0-based step).

    Warm-up ramps linearly from 1/warmup to 1 over the first `warmup_steps` updates; after it
    `linear` and `cosine` decay to 0 at `total_steps`. Steps past the end keep the last factor
    (a re-formed sync step or a straggler's late update must not get a negative lr).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose {', '.join(LR_SCHEDULES)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    # progress in [0, 1) over the decay phase; the last update gets a small positive lr
    progress = min(step - warmup_steps, total_steps - warmup_steps - 1) / (total_steps - warmup_steps)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
