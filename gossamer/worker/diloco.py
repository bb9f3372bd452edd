"""DiLoCo on parameter servers: H local steps with the inner optimizer, then the pseudo-gradient to the shards' outer step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from gossamer.faults import die_at
from gossamer.lr_schedule import lr_multiplier
from gossamer.paramserver.optimizer import OptimizerConfig, build_optimizer, set_lr_factor
from gossamer.worker.trainer import Hook, RankContext, Trainer, _Abandoned

log = logging.getLogger(__name__)


def schedule_lr(opt: torch.optim.Optimizer, exp: Any, step: int) -> None:
    """The experiment's lr schedule on a worker's own optimizer, for its 0-based `step`."""
    set_lr_factor(opt, exp.lr, exp.linear_lr_factor()
                  * lr_multiplier(step, exp.total_steps, exp.lr_schedule, exp.warmup_steps))


def inner_optimizer(exp: Any, params: Any) -> torch.optim.Optimizer:
    """The worker's own optimizer for the inner steps (`optimizer`, `lr`, ... of the experiment)."""
    return build_optimizer(
        OptimizerConfig(name=exp.optimizer, lr=exp.lr, momentum=exp.momentum, nesterov=exp.nesterov,
                        weight_decay=exp.weight_decay),
        list(params),
    )


class DilocoTrainer(Trainer):
    """One local rank of a DiLoCo worker (arXiv:2311.08105).

    A round: from the global parameters theta_0, take `inner_steps` H steps with the inner
    optimizer (AdamW by default; its state persists across rounds), then push the
    pseudo-gradient theta_0 - theta_H, compressed with the experiment's codec (int8 by
    default), divided by the number of workers so the shards' sum is the mean. The shards
    apply the outer optimizer (Nesterov SGD, `outer_lr`, `outer_momentum`) and reply with
    the new global parameters. A shard version is one round: progress is version x H.

    `outer_step="sync"`: a barrier over the current workers. When it re-forms (a worker lost
    or joined) the same pseudo-gradient is pushed again, scaled by the new worker count;
    the H steps are not recomputed. `outer_step="async"`: applied on arrival, the outer lr
    divided by the staleness in rounds.
    """

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], dict[str, Any] | None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop)
        self.inner = inner_optimizer(self.exp, self.model.parameters())
        self.rounds = 0
        self._pseudo: tuple[int, torch.Tensor | dict[int, torch.Tensor]] | None = None  # (version it started from, theta_0 - theta_H)

    @property
    def barrier(self) -> bool:
        return self.exp.outer_step == "sync"

    @property
    def progress(self) -> int:
        return (self._node_progress if self.layout is not None else self.version) * self.exp.inner_steps

    def _step_once(self) -> bool:
        start = self.version
        if self._pseudo is None or self._pseudo[0] != start:
            self._pseudo = (start, self._inner_round())
        delta = self._pseudo[1]
        scale = 1.0 / self.ctx.num_workers
        if isinstance(delta, dict):  # fsdp / pipeline: this rank's own chunks only
            grads = {idx: d * scale for idx, d in delta.items()}
        else:
            grads = {c.index: (delta[c.flat_offset : c.flat_offset + c.numel] * scale).cpu() for c in self.mine}
        die_at("mid-push", step=self.clock, **self.client.fault_ctx)
        self.client.fault_step = self.clock
        with self.profiler.region("communication"):
            res = self.client.push_pull(
                grads,
                clock=self.clock,
                basis=self.versions,
                step=start if self.barrier else None,
                num_workers=self.ctx.num_workers if self.barrier else None,
                generation=self.ctx.generation if self.barrier else None,
            )
        self._pseudo = None
        self.rounds += 1
        self._note_versions(res.versions)
        return self._assemble(res.values, res.done)

    def _inner_round(self) -> torch.Tensor | dict[int, torch.Tensor]:
        """H inner steps from the current (global) parameters; returns theta_0 - theta_H.

        With fsdp or pipeline the inner optimizer steps each rank's own shard or stage, and
        the pseudo-gradient is of this rank's chunks only (by chunk index). A stop request
        waits for the end of the round there: abandoning alone would leave the other local
        ranks in a collective.
        """
        if self.layout is not None:
            return self._inner_round_sharded()
        theta0 = self.flat.clone()
        for i in range(self.exp.inner_steps):
            if self.should_stop():
                self.flat.copy_(theta0)  # nothing of the round leaves this worker
                self._params_changed()
                raise _Abandoned
            with self.profiler.region("compute"):
                _, node_samples, _ = self._local_grad(self.client.fault_ctx)
            schedule_lr(self.inner, self.exp, self.progress + i)
            if not self.step_ok:  # fp16 overflow: this inner step is skipped
                self.skipped_steps += 1
                continue
            self.inner.step()
            if self.flat_grad is None:  # parameters are not views of `flat`: gather them
                from gossamer.paramserver import flatten_params

                self.flat.copy_(flatten_params(self.model))
            self._count(node_samples)
        return theta0.sub_(self.flat)

    def _inner_round_sharded(self) -> dict[int, torch.Tensor]:
        theta0 = self._own_values()
        for i in range(self.exp.inner_steps):
            with self.profiler.region("compute"):
                _, node_samples, _ = self._local_grad(self.client.fault_ctx)
            schedule_lr(self.inner, self.exp, self.progress + i)
            if not self.step_ok:
                self.skipped_steps += 1
                continue
            self.inner.step()
            self._count(node_samples)
        now = self._own_values()
        return {idx: theta0[idx].sub_(now[idx]) for idx in theta0}

    def _report(self, rate: float) -> None:
        self.on_metrics(self.progress, {"outer_rounds": float(self.rounds)})
        super()._report(rate)
