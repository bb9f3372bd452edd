"""async around a train function: the user's optimizer steps here, and each step's change goes to the shards."""

from __future__ import annotations

import torch

from gossamer.training.shards.shard_function import ShardFunctionTrainer

__all__ = ["AsyncFunctionTrainer"]


class AsyncFunctionTrainer(ShardFunctionTrainer):
    """async: after each user step the change since the last pull is pushed (the shard adds it, SGD at lr 1: any
    optimizer keeps its meaning) and the shard's values come back; with `overlap` the change leaves while the
    user's next step is computed."""

    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step, then its change out and the run's values in."""
        if self.done:
            return
        self._apply_updates()
        self._user_stepped(optimizer)
        self._send_change()
        self._report_now_and_then()
        self._maybe_eval(self.progress)

    def _exchange(self, change: dict[int, torch.Tensor]) -> None:
        """This step's change out; with `overlap` it leaves while the user's next step is computed.

        With `overlap` the reply to the previous push becomes the parameters less the change made since (it is on its
        way to the shards, not in the reply yet), so nothing of this worker's is lost or counted twice;
        each change is applied on values one step older than without overlap.
        """
        if not self.exp.overlap:
            self._exchange_change(change)
            return
        if self.client.in_flight:
            with self.profiler.region("communication"):
                res = self.client.wait()
            self._note_versions(res.versions)
            self.done = self._assemble({i: v - change[i] for i, v in res.values.items()}, res.done)
        if not self.done:
            with self.profiler.region("communication"):
                self.client.push_async(change, clock=self.clock, basis=dict(self.versions))
