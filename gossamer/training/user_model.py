"""What every mode's trainer of a train function shares: the user's model, its compute timed, its steps counted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer.core.errors import ConfigError
from gossamer.core.faults import die_at
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
        """The lead's local rank 0 evaluates (as at the end): one figure per evaluation, not one per rank."""
        return self.evaluator is not None and self.ctx.lead and self.ctx.local_rank == 0

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

    # --- several local ranks: the node's mean gradient, as torch DDP takes it -----------------------------
    should_stop: Callable[[], bool]
    _backward_queued = False
    #: A backward pass since the last step ended with the node's mean gradient (or the workers', in sync).
    _mean_taken = False
    #: Several local ranks: the stop the node's ranks agreed on at the end of the last backward pass.
    _node_stop = False
    _backward_hooks: tuple[Any, ...] = ()

    def _watch_backward(self, *, always: bool = False) -> None:
        """End every backward pass (outside `TrainContext.no_sync`) with `_backward_ended`: with several local
        ranks, or `always` (sync's exchange)."""
        if always or self.ctx.local_world > 1:
            self._backward_hooks = tuple(p.register_post_accumulate_grad_hook(self._on_grad)
                                         for p in self.layout.module.parameters()  # type: ignore[attr-defined]
                                         if p.requires_grad)

    def _unwatch_backward(self) -> None:
        for h in self._backward_hooks:
            h.remove()
        self._backward_hooks = ()

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._backward_queued and not self.done and self.wants_exchange():
            self._backward_queued = True  # once per backward pass, whichever parameter's gradient is first
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)  # type: ignore[attr-defined]

    def _backward_ended(self) -> None:
        self._backward_queued = False
        self._node_mean()
        self._mean_taken = True

    def _node_mean(self) -> None:
        """Several local ranks: every rank's `.grad` becomes the node's mean, in one all-reduce that also carries
        each rank's stop flag, so the ranks take the same step and end their loops at the same one."""
        if self.ctx.local_world == 1:
            return
        params = list(self.layout.module.parameters())  # type: ignore[attr-defined]
        device = params[0].device if params else self.ctx.device
        # After the gradients: which parameters have one on this rank, and the stop flag.
        flags = torch.tensor([*(float(p.grad is not None) for p in params), float(self.should_stop())],
                             device=device)
        flat = torch.cat([*(p.grad.detach().reshape(-1).float() if p.grad is not None
                            else torch.zeros(p.numel(), device=p.device) for p in params), flags])
        die_at("mid-allreduce", step=self.clock, worker=self.ctx.worker_index, rank=self.ctx.local_rank)
        dist.all_reduce(flat)
        total = flat.numel() - flags.numel()
        has = flat[total:-1].tolist()
        self._node_stop = bool(flat[-1].item() > 0)
        flat[:total].div_(self.ctx.local_world)
        offset = 0
        with torch.no_grad():
            for p, any_rank in zip(params, has, strict=True):
                piece = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(piece)
                elif any_rank > 0:  # another rank's gradient reached it: every rank steps it alike (as torch DDP)
                    p.grad = piece.to(p.dtype).clone()

    def _check_mean_taken(self) -> None:
        """Several local ranks: the step must follow a backward pass that took the node's mean (else the ranks
        would step apart)."""
        if self.ctx.local_world > 1 and not self._mean_taken:
            raise ConfigError("train", "with several local ranks optimizer.step() steps on the node's mean gradient, "
                                       "which the last backward() before it leaves in .grad: none since the previous "
                                       "step ran outside ctx.no_sync()")
        self._mean_taken = False

    def node_stopping(self) -> bool:
        """Whether this rank's loop should end for a stop: its own flag alone, or with several local ranks the
        one the node's ranks agreed on (a rank never leaves the others inside a collective)."""
        return self._node_stop if self.ctx.local_world > 1 else self.should_stop()

    def _user_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step, counted (a `delay` fault slows this worker's every step, as a straggler's)."""
        self._check_mean_taken()
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
