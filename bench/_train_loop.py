"""The loops bench/overhead.py times as train functions: AdamW (0.9, 0.95), one batch a step.

`train`: the digits MLP (26k parameters). `train_100m`: an MLP of about 100M parameters on random data,
each step stamped in `STEP_TIMES` (its few steps are timed one by one, the model's construction and
the first step left out).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gossamer.examples.digits import data, mlp

#: `train_100m`: the time each step began, and the end of the last (this process's latest run).
STEP_TIMES: list[float] = []
#: `train_100m`'s widths: 1024 in, seven hidden layers of 4096, 10 classes (104.9M parameters).
WIDTHS = (1024, *(4096,) * 7, 10)


def train(ctx: Any) -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model, optimizer = ctx.prepare(model, optimizer)
    for x, y in ctx.data(data()[0], batch_size=ctx.experiment.batch_size):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def big_mlp() -> nn.Module:
    """An MLP of `WIDTHS` (ReLU between the layers)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def train_100m(ctx: Any) -> None:
    model = big_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    model, optimizer = ctx.prepare(model, optimizer)
    g = torch.Generator().manual_seed(0)
    samples = TensorDataset(torch.randn(256, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (256,), generator=g))
    STEP_TIMES.clear()
    for x, y in ctx.data(samples, batch_size=ctx.experiment.batch_size):
        STEP_TIMES.append(time.perf_counter())
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    STEP_TIMES.append(time.perf_counter())
