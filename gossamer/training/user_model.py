"""What every mode's trainer of a train function shares: the user's model, its compute timed, its steps counted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gossamer.engine.profiling import StepProfiler
from gossamer.engine.rank import Hook, RankContext, StepStats

__all__ = ["UserModel", "flat_values"]


class UserModel:
    """What a trainer of a train function shares: the user's model, and no evaluation of gossamer's own."""

    _user_model: nn.Module
    ctx: RankContext
    on_metrics: Hook
    profiler: StepProfiler
    clock: int
    stats: StepStats
    reports_loss = False  # the train function reports its own loss
    #: sync: whether this backward pass exchanges (False inside `TrainContext.no_sync`); the runtime sets it.
    wants_exchange: Callable[[], bool]

    def _build(self) -> tuple[nn.Module, Any, Any]:
        return self._user_model.to(self.ctx.device), [], []

    #: The train function's evaluation (`TrainContext.evaluate_with`); without one it reports its own eval_*.
    evaluator: Callable[[], dict[str, float]] | None = None

    def _evaluates(self) -> bool:
        return self.evaluator is not None and self.ctx.lead

    def _evaluate(self, step: int) -> dict[str, float]:
        """The train function's evaluation, where it gave one, reported as gossamer's loop reports its own."""
        if self.evaluator is None:
            return {}
        values = {k if k.startswith("eval_") else f"eval_{k}": float(v) for k, v in self.evaluator().items()}
        self.on_metrics(step, {**values, "eval_step": float(step)})
        return values

    _t_report = 0.0
    _samples_reported = 0
    done = False
    _computing: contextlib.ExitStack | None = None

    _computing_since = 0.0
    #: Seconds the user's code computed before its latest step (the adaptive link weighs the exchange by it).
    computed_s = 0.0

    def user_computes(self) -> None:
        """From here to its next step the user's code computes: the profiler's window moves on and times it."""
        self.profiler.step(self.clock)
        self._computing = contextlib.ExitStack()
        self._computing.enter_context(self.profiler.region("compute"))
        self._computing_since = time.perf_counter()

    def user_computed(self) -> None:
        """The user's code reached its step (or returned)."""
        if self._computing is not None:
            self._computing.close()
            self._computing = None
            self.computed_s = time.perf_counter() - self._computing_since

    def _profile_end(self) -> None:
        self.user_computed()
        self.profiler.close(self.clock)

    def _user_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step, counted (a `delay` fault slows this worker's every step, as a straggler's)."""
        optimizer.step()
        self.clock += 1
        self.stats.steps += 1
        if self.ctx.step_delay_s:
            time.sleep(self.ctx.step_delay_s)

    def _counted_to_clock(self) -> None:
        """Done once this worker's own steps reach `total_steps` (gossip, sync: each worker takes every step)."""
        self.done = self.clock >= self.exp.total_steps  # type: ignore[attr-defined]
        self._report_now_and_then()

    @property
    def progress(self) -> int:
        """This worker's own steps (the trainer whose steps are the shards' versions says otherwise)."""
        return self.clock  # type: ignore[attr-defined,no-any-return]

    def _report_now_and_then(self) -> None:
        """The trainer's counters (bytes, updates, ...) once a second and at the end."""
        now = time.monotonic()
        if now - self._t_report >= 1.0 or self.done:
            since = self.stats.samples - self._samples_reported
            rate = since / max(1e-9, now - self._t_report) if self._t_report else 0.0
            self._t_report, self._samples_reported = now, self.stats.samples
            self._report(rate)  # type: ignore[attr-defined]  # the trainer's own: bytes, updates, ...


def flat_values(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors` end to end, as fp32 on the CPU (the plan's flat order, for the model's parameters)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
