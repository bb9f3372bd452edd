"""DiLoCo around a train function: the user's optimizer is the inner one; each round's change is the outer gradient."""

from __future__ import annotations

import torch

from gossamer.training.shards.shard_function import ShardFunctionTrainer

__all__ = ["DilocoFunctionTrainer"]


class DilocoFunctionTrainer(ShardFunctionTrainer):
    """DiLoCo (Douillard et al., 2023, arXiv:2311.08105) around any optimizer: the user's steps are the inner
    ones, and every `inner_steps` of them the round's change (theta_0 - theta_H) goes to the shards, whose outer
    optimizer (Nesterov SGD, `outer_lr`, `outer_momentum`) steps on the workers' mean, under the barrier (outer
    step sync) or on arrival (async). A shard version is one round."""

    _inner = 0

    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's (inner) step; at a round's end its change out and the run's values in."""
        if self.done:
            return
        self._apply_updates()
        self._user_stepped(optimizer)
        self._inner += 1
        if self._inner < self.exp.inner_steps:
            return
        self._inner = 0
        self._send_change()
        self._report_now_and_then()
        self._maybe_eval(self.progress)

    def _change_scale(self) -> float:
        """The shards add the round's pushes up: each worker's change over the workers in the round (their mean);
        a round redone after the barrier re-formed is scaled to its new count."""
        return 1.0 / self.ctx.num_workers

    @property
    def progress(self) -> int:
        """Optimizer steps of the run: rounds (shard versions) times `inner_steps`."""
        return self.node_version * self.exp.inner_steps
