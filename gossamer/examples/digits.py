"""Handwritten digits (scikit-learn's bundled `load_digits`, 1797 8x8 images): an MLP and a small CNN."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gossamer.core.errors import MissingExtraError

#: Fixed split: the last EVAL_SIZE samples of a seed-0 permutation are the eval set.
EVAL_SIZE = 360


def data(flat: bool = True) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, eval) datasets of (image, label); images scaled to [0, 1].

    Args:
        flat: images as 64-vectors (MLP) when True, as 1x8x8 tensors (CNN) when False.
    """
    pixels, labels = load()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    if not flat:
        x = x.view(-1, 1, 8, 8)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, held = order[:-EVAL_SIZE], order[-EVAL_SIZE:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[held], y[held])


def load() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (1797x64 pixels 0..16, labels): what `sklearn.datasets.load_digits` returns.

    Read from the CSV scikit-learn ships, without importing scikit-learn: its import costs about a
    second of CPU in every role process that builds these data.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        csv = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
        if csv.exists():
            table = np.loadtxt(csv, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise MissingExtraError("scikit-learn", "examples", "the digits data (gossamer.examples.digits)") from None
    bunch = load_digits()
    return bunch.data, bunch.target


def mlp(hidden: int = 128, depth: int = 2) -> nn.Module:
    """A ReLU MLP 64 -> hidden (x depth) -> 10."""
    layers: list[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def cnn(channels: int = 16) -> nn.Module:
    """Two 3x3 conv layers and a linear head, for 1x8x8 inputs (use `data(flat=False)`)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 4, 10),
    )


def cnn_data() -> tuple[TensorDataset, TensorDataset]:
    """`data(flat=False)`, for the CNN."""
    return data(flat=False)
