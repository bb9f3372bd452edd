"""The user module of bench/scale_model.py: a 104M-parameter MLP and a small synthetic classification set."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

WIDTH, DEPTH, INPUTS, CLASSES = 3584, 8, 256, 10


def mlp(width: int = WIDTH, depth: int = DEPTH, inputs: int = INPUTS, classes: int = CLASSES) -> nn.Module:
    """inputs -> depth x (width x width, ReLU) -> classes: 103.8M parameters (415 MB fp32) at the defaults."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def data(n: int = 1024, inputs: int = INPUTS, classes: int = CLASSES) -> tuple[TensorDataset, TensorDataset]:
    """Labels of a fixed random linear teacher over Gaussian inputs (train, eval)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n + 256, inputs, generator=g)
    teacher = torch.randn(inputs, classes, generator=g)
    y = (x @ teacher).argmax(1)
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])
