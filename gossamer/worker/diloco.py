"""DiLoCo on parameter servers: H local steps with the inner optimizer, then the pseudo-gradient to the shards' outer step."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gossamer.protocol import AssignmentUpdate
from gossamer.worker.optimizer import inner_optimizer, schedule_lr
from gossamer.worker.ps_trainer import ParameterServerTrainer
from gossamer.worker.rank import Hook, RankContext, StepAbandoned
from gossamer.worker.rank_trainer import OnSaved

log = logging.getLogger(__name__)


class DilocoTrainer(ParameterServerTrainer):
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
                 updates: Callable[[], AssignmentUpdate | None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_saved: OnSaved | None = None) -> None:
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop, on_saved=on_saved)
        self.inner = inner_optimizer(self.exp, self.model.parameters())
        self.rounds = 0
        # (the version the round started from, theta_0 - theta_H of this rank's chunks by index)
        self._pseudo: tuple[int, dict[int, torch.Tensor]] | None = None
        self._pseudo_scale = 1.0  # what the pseudo-gradient in `_pseudo` is already multiplied by

    @property
    def progress(self) -> int:
        return super().progress * self.exp.inner_steps

    def _step_once(self) -> bool:
        start = self.version
        if self._pseudo is None or self._pseudo[0] != start:
            self._pseudo = (start, self._inner_round())
            self._pseudo_scale = 1.0
        # Scaled in place (a pushed copy would be one more model-sized buffer); a redo after
        # the barrier re-formed rescales it to the new worker count.
        scale = 1.0 / self.ctx.num_workers
        for d in self._pseudo[1].values():
            d.mul_(scale / self._pseudo_scale)
        self._pseudo_scale = scale
        grads = {idx: d.cpu() for idx, d in self._pseudo[1].items()}
        done = self._push_pull(grads, step=start)
        self._pseudo = None
        self.rounds += 1
        return done

    def _inner_round(self) -> dict[int, torch.Tensor]:
        """H inner steps from the current (global) parameters; returns theta_0 - theta_H by chunk index.

        With fsdp or pipeline the inner optimizer steps each rank's own shard or stage, and
        the pseudo-gradient is of this rank's chunks only. A stop request waits for the end
        of the round there: abandoning alone would leave the other local ranks in a collective.
        """
        theta0 = self.layout.snapshot()
        for i in range(self.exp.inner_steps):
            if self.layout.holds_full_model and self.should_stop():
                self.layout.restore(theta0)  # nothing of the round leaves this worker
                raise StepAbandoned
            with self.profiler.region("compute"):
                _, node_samples, compute_s = self._local_grad(self.client.fault_ctx)
            self.compute_s += compute_s
            schedule_lr(self.inner, self.exp, self.progress + i)
            if not self.step_ok:  # fp16 overflow: this inner step is skipped
                self.skipped_steps += 1
                continue
            self.inner.step()
            self.layout.params_stepped()
            self._count(node_samples)
        # The gradient is not needed again before the next round's first backward: free it for the
        # exchange, where the reply and the pseudo-gradient are held instead.
        self.layout.release_gradients()
        return self.layout.chunk_delta(theta0)

    def _report(self, rate: float) -> None:
        self.on_metrics(self.progress, {"outer_rounds": float(self.rounds)})
        super()._report(rate)
