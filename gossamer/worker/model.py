"""The experiment's model and data as every process builds them (seeded alike), and whole-dataset evaluation."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gossamer._import_check import resolve
from gossamer.experiment import Experiment
from gossamer.worker.layout import loss_sum, stack_batch

__all__ = ["build", "evaluate"]


def build(exp: Experiment, device: torch.device, *, meta: bool = False) -> tuple[nn.Module, Any, Any]:
    """Model (seeded, so every process builds identical initial parameters) and (train, eval) data.

    `meta=True` builds the model on the meta device (shapes only, no memory) when it has no
    buffers: a sharded layout then allocates only its own part, and the values come from
    the parameter servers at the first pull. A model with buffers (batch-norm statistics,
    which the servers do not hold) is built for real.
    """
    torch.manual_seed(exp.seed)
    if meta:
        with torch.device("meta"):
            shape_only = resolve(exp.model)(**exp.model_args)  # type: ignore[operator]
        if not any(True for _ in shape_only.buffers()):
            train, evalset = resolve(exp.dataset)(**exp.dataset_args)  # type: ignore[operator]
            return shape_only, train, evalset
        torch.manual_seed(exp.seed)
    model = resolve(exp.model)(**exp.model_args).to(device)  # type: ignore[operator]
    train, evalset = resolve(exp.dataset)(**exp.dataset_args)  # type: ignore[operator]
    return model, train, evalset


@torch.no_grad()
def evaluate(model: nn.Module, ds: Any, device: torch.device, batch: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over a whole dataset, per prediction (per token for sequences)."""
    model.eval()
    correct, loss, count, n = 0, 0.0, 0, len(ds)
    for start in range(0, n, batch):
        x, y = stack_batch(ds, torch.arange(start, min(n, start + batch)))
        out = model(x.to(device))
        total, k = loss_sum(out, y.to(device))
        loss += total.item()
        count += k
        correct += (out.argmax(-1).cpu() == y).sum().item()
    model.train()
    return correct / max(1, count), loss / max(1, count)
