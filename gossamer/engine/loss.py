"""The experiment's loss (`Experiment.loss`): a batch's loss summed over its predictions, and their count."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from gossamer.core.errors import ConfigError
from gossamer.core.import_check import resolve
from gossamer.engine.batches import batch_samples, call_model, describe, without_labels

__all__ = ["EvalTotals", "Objective", "loss_sum"]


def loss_sum(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy (in fp32, whatever autocast produced) and the number of predictions.

    Classifiers give (B, C) logits for (B,) labels; sequence models (B, T, V) for (B, T)
    targets, and every position counts as one prediction.
    """
    if out.dim() > 2:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return F.cross_entropy(out.float(), y, reduction="sum"), y.numel()


def _logits(out: Any) -> torch.Tensor:
    """A model's prediction tensor: the output itself, or its `logits` (transformers' outputs)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError("loss", f"the model returned a {type(out).__name__}, not a tensor or an output with "
                                  "`logits`; use loss='model' if it computes its own loss")
    return logits


def _model_loss(out: Any) -> torch.Tensor:
    """The loss a model computed: a scalar output, its `.loss`, or its "loss" entry."""
    loss = out if isinstance(out, torch.Tensor) else \
        out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError("loss", f"loss='model', but the model returned a {type(out).__name__} without a loss "
                                  "(a scalar tensor, `.loss` or a 'loss' entry); give it the labels in the batch")
    if loss.numel() != 1:
        raise ConfigError("loss", f"loss='model', but the model's loss has shape {tuple(loss.shape)}, not a scalar")
    return loss.reshape(())


class Objective:
    """The loss a node trains on, as sums: exact over any split of a batch into ranks or micro-batches.

    Each loss is a sum over predictions divided by their count, so a node's gradient of
    sum / (samples x predictions per sample) equals the mean loss of one process over the
    whole batch. `cross_entropy` and `mse` sum over elements (per token for sequences, per
    output for regression); a user function and `model` return a batch mean, counted as one
    prediction per sample (sum = mean x samples), which is exact when the loss is a mean over
    samples (as `F.mse_loss`, `F.cross_entropy` and a causal LM's token mean over equal-length rows).
    """

    def __init__(self, spec: str = "cross_entropy") -> None:
        self.spec = spec
        self.kind = spec if spec in ("cross_entropy", "mse", "model") else "callable"
        self._fn: Callable[..., Any] | None = None
        self._forwarded = False  # the first forward names a batch the model cannot take
        if self.kind == "callable":
            self._fn = resolve(spec)  # type: ignore[assignment]

    @property
    def classification(self) -> bool:
        """Whether accuracy (argmax against the labels) means something for this loss."""
        return self.kind == "cross_entropy"

    @property
    def language_model(self) -> bool:
        """Whether the loss is a mean token cross-entropy whose exp is a perplexity (`model`: assumed)."""
        return self.kind == "model"

    @property
    def needs_target(self) -> bool:
        return self.kind != "model"

    # --- batches ------------------------------------------------------------------------
    def split(self, batch: Any) -> tuple[Any, Any]:
        """(model inputs, target) of a batch: an (input, target) pair or a dict holding `labels`."""
        if isinstance(batch, Mapping):
            if "labels" not in batch:
                raise ConfigError("dataset", f"loss={self.spec!r} needs a target: a dict batch must hold 'labels' "
                                             f"(it has {sorted(batch)}), or use loss='model'")
            return without_labels(batch), batch["labels"]
        if isinstance(batch, tuple | list) and len(batch) == 2:
            return batch[0], batch[1]
        raise ConfigError("dataset", f"loss={self.spec!r} needs (input, target) batches or dicts with 'labels', "
                                     f"got a {type(batch).__name__}")

    def forward(self, module: Any, batch: Any) -> Any:
        """The model's output on `batch` (`model`: the whole batch as keyword or positional arguments).

        Raises:
            ConfigError: naming `dataset` when the model cannot take the first batch it is given
                (a later failure is the model's own and passes through unchanged).
        """
        if self._forwarded:
            return self._forward(module, batch)
        try:
            out = self._forward(module, batch)
        except (TypeError, ValueError, IndexError, RuntimeError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise ConfigError("dataset", f"the model cannot take a batch of {describe(batch)} (loss={self.spec!r}): "
                                         f"{type(e).__name__}: {e}") from e
        self._forwarded = True
        return out

    def _forward(self, module: Any, batch: Any) -> Any:
        if self.kind == "model":
            if isinstance(batch, Mapping):
                return module(**batch)
            return module(*batch) if isinstance(batch, tuple | list) else module(batch)
        return call_model(module, self.split(batch)[0])

    def predictions(self, batch: Any) -> int:
        """How many predictions the summed loss of `batch` adds up (known before the forward)."""
        if self.kind in ("cross_entropy", "mse"):
            return int(torch.as_tensor(self.split(batch)[1]).numel())
        return batch_samples(batch)

    def per_sample(self, batch: Any) -> int:
        """Predictions per sample: 1 for classifiers and batch-mean losses, T for sequences."""
        return max(1, self.predictions(batch) // max(1, batch_samples(batch)))

    # --- the loss ----------------------------------------------------------------------
    def loss_sum(self, out: Any, batch: Any) -> tuple[torch.Tensor, int]:
        """`batch`'s loss summed over its predictions (fp32), and their count."""
        if self.kind == "model":
            n = batch_samples(batch)
            return _model_loss(out).float() * n, n
        return self.target_loss_sum(out, self.split(batch)[1])

    def target_loss_sum(self, out: Any, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The summed loss of predictions `out` against the target `y` (not for loss='model')."""
        pred = _logits(out)
        if self.kind == "cross_entropy":
            return loss_sum(pred, y)
        if self.kind == "mse":
            if pred.shape != y.shape and pred.numel() == y.numel():
                pred = pred.reshape(y.shape)  # (B, 1) predictions of (B,) targets
            return F.mse_loss(pred.float(), y.float(), reduction="sum"), y.numel()
        assert self._fn is not None
        value = self._fn(out, y)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError("loss", f"{self.spec} returned {shape}; it must return the batch-mean loss as a "
                                      "scalar tensor")
        n = int(y.shape[0]) if isinstance(y, torch.Tensor) and y.dim() else batch_samples(out)
        return value.reshape(()).float() * n, n

    def correct(self, out: Any, batch: Any) -> float:
        """How many of `batch`'s predictions are right (argmax against the labels; classification only)."""
        y = self.split(batch)[1]
        return float((_logits(out).argmax(-1) == y).sum())


class EvalTotals:
    """What an evaluation adds up over batches (summed across ranks as one tensor) and the metrics it gives."""

    def __init__(self, objective: Objective) -> None:
        self.objective = objective
        self.sums = torch.zeros(4, dtype=torch.float64)  # correct, summed loss, predictions, sequence batches

    def add(self, out: Any, batch: Any) -> None:
        total, k = self.objective.loss_sum(out, batch)
        correct = seq = 0.0
        if self.objective.classification:
            correct = self.objective.correct(out, batch)
            seq = float(_logits(out).dim() > 2)
        self.sums += torch.tensor([correct, float(total.detach()), float(k), seq], dtype=torch.float64)

    def metrics(self) -> dict[str, float]:
        """eval_loss (mean per prediction); eval_accuracy for classification; eval_perplexity for language models."""
        correct, total, count, seq = (float(v) for v in self.sums)
        loss = total / max(1.0, count)
        out = {"eval_loss": loss}
        if self.objective.classification:
            out["eval_accuracy"] = correct / max(1.0, count)
        if self.objective.language_model or seq > 0:
            out["eval_perplexity"] = math.exp(min(loss, 700.0))
        return out
