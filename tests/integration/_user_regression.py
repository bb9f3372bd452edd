"""A user's own workload, as an Experiment names it: a regression model, its loss, an endless stream, metrics.

The data: y = x . w + noise, x ~ N(0, I) in `dim` dimensions, noise ~ N(0, noise^2). A model
that learns w leaves only the noise, so its mean squared error tends to noise^2 (the floor).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset


def _weights(dim: int, seed: int) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(1000 + seed))


def _samples(n: int, dim: int, noise: float, seed: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + stream)
    x = torch.randn(n, dim, generator=g)
    return x, x @ _weights(dim, seed) + noise * torch.randn(n, generator=g)


class RegressionStream(IterableDataset):  # type: ignore[type-arg]
    """An endless stream of (x, y) pairs, the same sequence every time it is iterated (from `seed`)."""

    def __init__(self, dim: int, noise: float, seed: int, block: int = 256) -> None:
        self.dim, self.noise, self.seed, self.block = dim, noise, seed, block

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        k = 0
        while True:
            x, y = _samples(self.block, self.dim, self.noise, self.seed, stream=1 + k)
            yield from zip(x, y, strict=True)
            k += 1


class FiniteStream(IterableDataset):  # type: ignore[type-arg]
    """The first `n` pairs of the regression stream, then the end."""

    def __init__(self, n: int, dim: int, noise: float, seed: int) -> None:
        self.n, self.inner = n, RegressionStream(dim, noise, seed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.n:
                return
            yield item


def linear(dim: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 1), nn.Flatten(0))


def mlp(dim: int = 8, hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1), nn.Flatten(0))


def half_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The user's own loss: 0.5 x mean squared error over the batch (a batch mean, as the loop expects)."""
    return 0.5 * (output.reshape(target.shape) - target).pow(2).mean()


def per_sample_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A broken loss: per-sample errors, not the batch mean (the loop must refuse it, naming `loss`)."""
    return (output.reshape(target.shape) - target).pow(2)


def stream_data(dim: int = 8, noise: float = 0.1, seed: int = 0, eval_n: int = 2000) -> tuple[Any, Any]:
    """(endless training stream, held-out eval set of `eval_n` fresh samples)."""
    return RegressionStream(dim, noise, seed), TensorDataset(*_samples(eval_n, dim, noise, seed, stream=0))


def finite_stream_data(n: int = 200, dim: int = 8, noise: float = 0.1, seed: int = 0) -> tuple[Any, Any]:
    return FiniteStream(n, dim, noise, seed), FiniteStream(n, dim, noise, seed)


def tensor_data(n: int = 4096, dim: int = 8, noise: float = 0.1, seed: int = 0) -> tuple[Any, Any]:
    """A map-style regression set (for runs compared sample for sample with one process)."""
    return TensorDataset(*_samples(n, dim, noise, seed, stream=1)), TensorDataset(*_samples(512, dim, noise, seed, 0))


class DictRows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Hugging Face style rows: {"features": x, "labels": y}."""

    def __init__(self, pairs: TensorDataset) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.pairs[i]
        return {"features": x, "labels": y}


class KeywordRegressor(nn.Module):
    """A model called with keyword inputs that computes its own loss when given labels (as transformers models do)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.net = nn.Linear(dim, 1)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pred = self.net(features).squeeze(-1)
        out = {"logits": pred}
        if labels is not None:
            out["loss"] = (pred - labels).pow(2).mean()
        return out


def keyword_regressor(dim: int = 8) -> nn.Module:
    return KeywordRegressor(dim)


def dict_data(n: int = 4096, dim: int = 8, noise: float = 0.1, seed: int = 0) -> tuple[Any, Any]:
    train, evalset = tensor_data(n, dim, noise, seed)
    return DictRows(train), DictRows(evalset)


def pairs_as_dict(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A user `collate`: a list of (x, y) samples as one dict batch."""
    return {"features": torch.stack([x for x, _ in items]), "labels": torch.stack([y for _, y in items])}


def regression_metrics(model: nn.Module, evalset: Any) -> dict[str, float]:
    """The user's own evaluation figures: mean absolute error and R^2 on the eval set."""
    device = next(model.parameters()).device  # the worker's: a GPU where the node has one
    x, y = (t.to(device) for t in evalset.tensors)
    pred = model(x).reshape(y.shape)
    return {"mae": float((pred - y).abs().mean()), "r2": float(1 - (pred - y).pow(2).sum() / (y - y.mean()).pow(2).sum())}


def not_a_pair() -> Any:
    """A broken dataset callable: one dataset, not a (train, eval) pair."""
    return tensor_data()[0]


def not_datasets() -> Any:
    """A broken dataset callable: a pair of things the loop cannot read."""
    return 3, 4
