"""The experiment's model and data as every process builds them (seeded alike), and whole-dataset evaluation."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.core.import_check import resolve
from gossamer.engine.batches import Data, to_device
from gossamer.engine.loss import EvalTotals, Objective

__all__ = ["build", "evaluate", "evaluate_metrics", "experiment_data", "user_metrics"]


def build(exp: Experiment, device: torch.device, *, meta: bool = False) -> tuple[nn.Module, Any, Any]:
    """Model (seeded, so every process builds identical initial parameters) and (train, eval) data.

    `meta=True` builds the model on the meta device (shapes only, no memory) when it has no
    buffers: a sharded layout then allocates only its own part, and the values come from
    the parameter servers at the first pull. A model with buffers (batch-norm statistics,
    which the servers do not hold) is built for real.

    Raises:
        ConfigError: the model callable gave no nn.Module, or the dataset callable no (train, eval) pair.
    """
    torch.manual_seed(exp.seed)
    if meta:
        with torch.device("meta"):
            shape_only = _model(exp)
        if not any(True for _ in shape_only.buffers()):
            return shape_only, *_datasets(exp)
        torch.manual_seed(exp.seed)
    model = _model(exp).to(device)
    return model, *_datasets(exp)


def _model(exp: Experiment) -> nn.Module:
    model = resolve(exp.model)(**exp.model_args)  # type: ignore[operator]
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"{exp.model} returned a {type(model).__name__}, not a torch nn.Module")
    return model


def _datasets(exp: Experiment) -> tuple[Any, Any]:
    pair = resolve(exp.dataset)(**exp.dataset_args)  # type: ignore[operator]
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise ConfigError("dataset", f"{exp.dataset} returned a {type(pair).__name__}; it must return a "
                                     "(train, eval) pair of datasets")
    return pair[0], pair[1]


def experiment_data(exp: Experiment, train: Any, evalset: Any) -> tuple[Data, Data]:
    """The (train, eval) sets as the loop reads them, with the experiment's `collate`.

    Raises:
        ConfigError: naming `dataset` when a set is not a dataset the loop can read.
    """
    collate = resolve(exp.collate) if exp.collate else None
    return Data(train, collate=collate), Data(evalset, collate=collate)  # type: ignore[arg-type]


@torch.no_grad()
def evaluate_metrics(model: nn.Module, data: Any, device: torch.device, objective: Objective | None = None,
                     batch: int = 1024, limit: int = 0) -> dict[str, float]:
    """eval_loss, and eval_accuracy / eval_perplexity where they apply, of `model` over a whole dataset."""
    objective = objective or Objective()
    data = Data.wrap(data)
    totals = EvalTotals(objective)
    model.eval()
    try:
        for sel in data.eval_selections(batch, limit):
            b = to_device(data.batch(sel), device)
            totals.add(objective.forward(model, b), b)
    finally:
        model.train()
    return totals.metrics()


def evaluate(model: nn.Module, ds: Any, device: torch.device, batch: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over a whole dataset, per prediction (per token for sequences)."""
    m = evaluate_metrics(model, ds, device, batch=batch)
    return m["eval_accuracy"], m["eval_loss"]


@torch.no_grad()
def user_metrics(exp: Experiment, model: nn.Module, evalset: Any) -> dict[str, float]:
    """The experiment's `metrics` callable on (model, eval set), as eval_<name> figures.

    The model is on the worker's device (a GPU where the node has one); the eval set is as the
    dataset callable returned it.

    Raises:
        ConfigError: naming `metrics` when it raises, or returns anything but a mapping of names
            to finite-or-not floats.
    """
    if not exp.metrics:
        return {}
    model.eval()
    try:
        got = resolve(exp.metrics)(model, evalset)  # type: ignore[operator]
    except ConfigError:
        raise
    except Exception as e:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        hint = (f"; the model is on {device}: move the eval data to next(model.parameters()).device"
                if device.type != "cpu" else "")
        raise ConfigError("metrics", f"{exp.metrics} raised {type(e).__name__}: {e}{hint}") from e
    finally:
        model.train()
    if not isinstance(got, dict):
        raise ConfigError("metrics", f"{exp.metrics} returned a {type(got).__name__}, not a dict of name -> float")
    out: dict[str, float] = {}
    for name, v in got.items():
        try:
            value = float(v)
        except (TypeError, ValueError):
            raise ConfigError("metrics", f"{exp.metrics} returned {name!r}: {v!r}, not a number") from None
        if not isinstance(name, str) or not name.replace("_", "").isalnum():
            raise ConfigError("metrics", f"{exp.metrics} returned the name {name!r}; use letters, digits and _")
        out[name if name.startswith("eval_") else f"eval_{name}"] = value if math.isfinite(value) else float("nan")
    return out
