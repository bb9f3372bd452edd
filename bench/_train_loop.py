"""The loop bench/overhead.py times as a train function: the digits MLP, AdamW (0.9, 0.95), one batch a step."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gossamer.examples.digits import data, mlp


def train(ctx: Any) -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model, optimizer = ctx.prepare(model, optimizer)
    for x, y in ctx.data(data()[0], batch_size=ctx.experiment.batch_size):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
