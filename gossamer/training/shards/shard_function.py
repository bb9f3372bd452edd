"""What the modes with parameter-server shards share under a train function: the shards' values in, the run ended."""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
from torch import nn

from gossamer.core.errors import ShardError
from gossamer.core.faults import die_at, hold_at
from gossamer.core.protocol import AssignmentUpdate
from gossamer.engine.rank import Hook, RankContext
from gossamer.training.rank_trainer import OnSaved
from gossamer.training.shards.ps_trainer import ParameterServerTrainer
from gossamer.training.user_model import UserModel
from gossamer.transport.router import REFORM

__all__ = ["ShardFunctionTrainer"]


class ShardFunctionTrainer(UserModel, ParameterServerTrainer, abc.ABC):
    """A train function's worker over the experiment's shards: it registers, takes the run's values, pushes what
    its mode's `user_step` says (async's change, DiLoCo's round, sync's gradient) and ends the run as gossamer's
    own loop does. Each mode's unit subclasses it (`Mode.function_trainer`)."""

    #: Changes are taken against the values of the last exchange (False: the step pushes something else).
    keeps_basis = True
    #: Every backward pass ends with the mode's exchange (sync), not only with the node's mean (several local ranks).
    exchanges_in_backward = False

    def __init__(self, ctx: RankContext, model: nn.Module, *, on_metrics: Hook | None = None,
                 updates: Callable[[], AssignmentUpdate | None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_saved: OnSaved | None = None) -> None:
        self._user_model = model
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop, on_saved=on_saved)
        self.done = False
        self._basis: dict[int, torch.Tensor] = {}
        self._params = list(self.layout.module.parameters())
        self.wants_exchange = lambda: True  # the runtime's says where `TrainContext.no_sync` holds it
        self._watch_backward(always=self.exchanges_in_backward)

    def start(self) -> None:
        """Register with the shards and take the run's current values (the basis of the first change)."""
        self.client.hello(fresh=True)
        self.done = self.pull()
        self._basis = self.layout.chunk_values() if self.keeps_basis else {}
        self._exchanging = True

    @abc.abstractmethod
    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step and the mode's exchange (each mode's unit says how)."""

    def _send_change(self) -> None:
        """The change since the last exchange out, the run's values in, and the next change's basis taken (a copy
        of the parameters the reply was written into)."""
        change = {i: self._basis[i] - v for i, v in self.layout.chunk_values().items()}
        self._exchange(change)
        self._basis = self.layout.chunk_values()

    def _exchange(self, change: dict[int, torch.Tensor]) -> None:
        """How the change goes (async with `overlap`: while the next step computes)."""
        self._exchange_change(change)

    def _change_scale(self) -> float:
        """What a change is multiplied by before it goes (DiLoCo's round: 1 / workers); 1 by default."""
        return 1.0

    def _exchange_change(self, change: dict[int, torch.Tensor]) -> None:
        """Push this step's change and take the shards' values; under a re-formed barrier, to the new round, with
        the change scaled again (`_change_scale`) for the new worker count."""
        scaled = 1.0  # what `change` is already multiplied by: scaled in place (the caller's own copy)
        for attempt in range(100):
            generation = self.ctx.generation
            want = self._change_scale()
            if want != scaled:
                for c in change.values():
                    c.mul_(want / scaled)
                scaled = want
            try:
                self.done = self._push_pull(change, step=self.version)
                return
            except ShardError as e:  # a re-formed barrier: the same change goes again to the new round
                if not self.barrier or REFORM not in e.codes or attempt == 99:
                    raise
                self._await_generation(generation)

    def _past_the_end(self) -> None:
        """Past the last step: its final counters go next (a test holds or kills it here, as gossamer's loop)."""
        hold_at("final-report", **self.client.fault_ctx)
        die_at("final-report", step=self.clock, **self.client.fault_ctx)

    @property
    def progress(self) -> int:
        """Optimizer steps of the run: shard versions (DiLoCo's unit counts its rounds' inner steps)."""
        return self.node_version

    def _agrees_on_node(self) -> bool:
        """Several local ranks decide the end, progress, lead and stop together: each talks to the shards of its
        own chunks (a small model's may be none) and all of them meet in the backward pass's all-reduce."""
        return self.ctx.local_world > 1 or super()._agrees_on_node()

    def _abandons_alone(self) -> bool:
        """A step is given up mid-exchange by one rank only where it is the node's only one: otherwise the node's
        ranks stop together, at the step they agreed on."""
        return self.ctx.local_world == 1

    def end(self) -> None:
        """The train function returned: finish the run as gossamer's own loop does."""
        self._profile_end()
        self._unwatch_backward()
        self._exchanging = False
        if self.client.in_flight and self._stopping():  # told to leave mid-overlap: the change goes or not, whole
            self.client.abandon()
        elif self.client.in_flight:  # overlap: the last change's reply (no step since: nothing to keep back)
            res = self.client.wait()
            self._note_versions(res.versions)
            self.done = self._assemble(res.values, res.done) or self.done
        if self.done:
            self._past_the_end()
            self._apply_updates()
            if self._agrees_on_node():
                self._agree(True)  # the node's ranks take the lead flag and the stop together
            self._await_lead()
            if self.ctx.lead and not self._stopping():
                die_at("before-finish", step=self.progress, **self.client.fault_ctx)
                self._drop_training_state()  # before the final values come in: nothing trains again
                self.pull()
                self.finish()
        self.client.leave()
        self.client.close()
        self.finished = self.done
