"""gossamer's built-in loop in async and sync: each step's gradient to the shards, which step the experiment's optimizer."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from gossamer.core.errors import ShardError
from gossamer.engine.rank import RankContext
from gossamer.training.shards.shard_function import ShardFunctionTrainer
from gossamer.training.user_model import flat_values
from gossamer.transport.router import FAILED_PRECONDITION, REFORM

log = logging.getLogger(__name__)

__all__ = ["GradientPushTrainer", "StepRedo"]


class StepRedo(Exception):  # noqa: N818 - control flow between the sync trainer and gossamer's own loop
    """sync: the barrier re-formed during this step's exchange, or the shards moved on; its samples are now the
    new workers' shares, so gossamer's own loop computes the step again (out of `optimizer.step()`, as the older
    trainer does). A user's loop sends the same gradient again."""


class GradientPushTrainer(ShardFunctionTrainer):
    """The exchange of gossamer's built-in loop in async and sync (`shards_step_optimizer`): the step pushes its
    gradient and the shards step the experiment's optimizer on it, so the run keeps one optimizer state (a worker
    that joins or replaces one takes the run's), its lr schedule and the staleness-aware lr; the codec, density
    warm-up, adaptive link and overlap are the older trainer's (`ParameterServerTrainer._send_gradient`)."""

    keeps_basis = False  # nothing steps here: the gradient goes

    def __init__(self, ctx: RankContext, model: nn.Module, **hooks: Any) -> None:
        super().__init__(ctx, model, **hooks)
        self._redos = 0  # sync: the steps computed again in a row (`_push_gradient`)

    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's gradient out (the membership changes after the push: its gradient is of the step's workers)."""
        if self.done:
            return
        self._push_gradient()
        self._apply_updates()
        self._report_now_and_then()
        self._maybe_eval(self.progress)

    def _push_gradient(self) -> None:
        """This step's gradient to the shards and their values back, as the older trainer's step pushes it; then
        the step is counted.

        sync: where the barrier re-formed or the shards moved on, `StepRedo`: gossamer's own loop computes the
        step again over the workers now (the older trainer's redo), so nothing is counted twice. A node of several
        local ranks sends the same gradient again instead, as a user's loop does: its ranks push their own chunks,
        perhaps to different shards, so one rank may be refused where another's push went through (or waits on
        the refused one's part), and a rank computing again alone would meet the others in other collectives.
        """
        if self.ctx.step_delay_s:  # a `delay` fault: a straggler's every step
            time.sleep(self.ctx.step_delay_s)
        flat = flat_values([p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params])
        grads = {c.index: flat[c.flat_offset:c.flat_offset + c.numel] for c in self.mine}
        while True:
            generation = self.ctx.generation  # the step's: no update is taken between its compute and its push
            try:
                self.done = self._send_gradient(grads, self.computed_s)
                break
            except ShardError as e:
                if not self.barrier or not ({REFORM, FAILED_PRECONDITION} & set(e.codes)) or self._redos >= 99:
                    raise
                self.redone += 1
                self._redos += 1
                if REFORM in e.codes:
                    self._await_generation(generation)
                else:
                    log.info("shards moved on or rolled back (%s); pulling their versions", e)
                    time.sleep(0.05 * min(self._redos, 10))
                    if self.ctx.local_world > 1:  # this rank's shards' versions (the values come with the push)
                        self._note_versions(self.client.pull().versions)
                    else:
                        self.done = self.pull()
                if self.ctx.local_world == 1:
                    raise StepRedo from e
        self._redos = 0
        self.compute_s += self.computed_s
        self.clock += 1
        self.stats.steps += 1
