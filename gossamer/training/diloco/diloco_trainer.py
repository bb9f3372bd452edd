"""DiLoCo on parameter servers: H local steps with the inner optimizer, then the pseudo-gradient to the shards' outer step."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from gossamer.core.errors import ShardError, UnavailableError
from gossamer.core.protocol import AssignmentUpdate
from gossamer.engine.layout import ReplicatedLayout
from gossamer.engine.rank import Hook, RankContext, StepAbandoned
from gossamer.training.diloco.round_start import RoundStart
from gossamer.training.diloco.step_in_backward import StepInBackward
from gossamer.training.local_optimizer import inner_optimizer, schedule_lr
from gossamer.training.rank_trainer import OnSaved
from gossamer.training.shards.ps_trainer import ParameterServerTrainer

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

    Memory (bench/scale_model.py): where nothing needs the whole gradient before the inner
    step (one local rank, no clipping, no fp16 loss scaling) the inner optimizer steps each
    parameter inside backward (`StepInBackward`), so no whole-model gradient is held. On one
    local rank without a pull codec the round's start is a `RoundStart`: each chunk's theta_0
    with its error-feedback residual folded in, one buffer where two were held, which the
    compressor turns into the new residual in place; the round is exchanged shard by shard: each
    push is answered with an ack, and the shard's new values are pulled a group of chunks at a time
    (`ParameterServerTrainer._pull_by_group`), so no shard's reply is held whole. A push the
    re-formed barrier refused rebuilds its buffers from the residual and the refused payload (`ChunkCompressor.take_back`); a part not
    held (no feedback, or a worker count changed since the fold) is pulled again from the
    shards, which hold theta_0 until the barrier completes. `round_start="shards"`: nothing is
    held over the round; each shard's part is pulled and folded at the exchange. A stop
    mid-round pulls theta_0 back. Elsewhere (several local ranks, a pull codec, chunks where
    feedback runs on some segments only) theta_0 is one copy, the residual apart, and the
    pseudo-gradient is kept over the exchange; a refused push gives the residual back there too.
    """

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], AssignmentUpdate | None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_saved: OnSaved | None = None) -> None:
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop, on_saved=on_saved)
        self.inner = inner_optimizer(self.exp, self.model.parameters())
        self.stepper: StepInBackward | None = None
        layout = self.layout
        if isinstance(layout, ReplicatedLayout) and layout.world == 1 and self.scaler is None \
                and not self.exp.max_grad_norm:
            layout.step_in_backward()
            self.stepper = StepInBackward(self.inner, layout.module)
        # The round's start is exactly what the shards hold until every worker pushed (its chunks are all this
        # rank's; no pull codec): a part of it not held can be pulled again.
        exact = layout.world == 1 and self.exp.pull_compression == "none"
        self._from_shards = self.exp.round_start == "shards" and layout.world == 1
        if self.exp.round_start == "shards" and layout.world > 1:
            # A node's local ranks are not known at submit: this node keeps the start instead of failing its role.
            log.warning("round_start 'shards' exchanges shard by shard, which one local rank does; this node runs %d: "
                        "keeping the round's start in memory", layout.world)
        comp = self.client.compressor
        folds = comp is None or (comp.momentum is None and all(comp.feeds_back(c.index) is not None for c in self.mine))
        #: One local rank, theta_0 exactly the shards': the round's start by chunk with the residual folded in,
        #: exchanged shard by shard. None: the start is one copy and the residual apart (`_pseudo`).
        self.start: RoundStart | None = None
        if isinstance(layout, ReplicatedLayout) and exact and (folds or self._from_shards):
            self.start = RoundStart(layout, comp, keep=not self._from_shards)
        # By shard: the version the inner steps of the pending round started from, and the shards its part
        # was exchanged with already (a push refused by a re-formed barrier goes on from there).
        self._pending: int | None = None
        self._sent: set[int] = set()
        self.rounds = 0
        # (the version the round started from, theta_0 - theta_H of this rank's chunks by index)
        self._pseudo: tuple[int, dict[int, torch.Tensor]] | None = None
        self._pseudo_scale = 1.0  # what the pseudo-gradient in `_pseudo` is already multiplied by

    @property
    def progress(self) -> int:
        return super().progress * self.exp.inner_steps

    def _step_once(self) -> bool:
        if self.start is not None:
            return self._round_by_shard(self.start)
        # Several local ranks, a pull codec, or chunks where error feedback runs on some segments only: the
        # round's start is one copy, the residual apart, and the pseudo-gradient is kept over the exchange.
        start = self.version
        if self._pseudo is None or self._pseudo[0] != start:
            self._pseudo = (start, self._inner_round())
            self._pseudo_scale = 1.0
        # Scaled in place (a pushed copy would be one more model-sized buffer); a redo after
        # the barrier re-formed rescales it to the new worker count.
        scale = 1.0 / self.ctx.num_workers
        pseudo = self._pseudo[1]
        _scale(pseudo, scale / self._pseudo_scale)
        self._pseudo_scale = scale
        comp = self.client.compressor

        def refused(recorded: dict[int, Any]) -> None:  # the residual goes back to before the push
            assert comp is not None
            for i in list(recorded):
                comp.take_back(i, pseudo[i])

        done = self._recorded_push({idx: d.cpu() for idx, d in pseudo.items()}, start, refused)
        self._pseudo = None
        self.rounds += 1
        return done

    def _recorded_push(self, grads: dict[int, torch.Tensor], start: int,
                       refused: Callable[[dict[int, Any]], None], *, values: bool = True) -> bool:
        """Push `grads` (emptied once encoded). Where a barrier may refuse it whole, the compressor's encodes are
        recorded meanwhile and a refusal calls `refused` with them before the error goes on (`take_back`).
        `values` False: acknowledged only (`ParameterServerTrainer._push_pull`)."""
        comp = self.client.compressor
        push = functools.partial(self._push_pull, grads, step=start, consume=True, values=values)
        if comp is None:
            return push()
        try:
            if not self.barrier:
                return push()
            comp.recorded = {}
            try:
                return push()
            except ShardError:
                refused(comp.recorded)
                raise
            finally:
                comp.recorded = None
        finally:
            # One push a round: its wire buffers are not kept for the next (about a quarter of the model with int8).
            comp.release_buffers()

    def _round_by_shard(self, rs: RoundStart) -> bool:
        """A round exchanged shard by shard from its start `rs`: after the H steps, for each shard, the
        compensated pseudo-gradient of its chunks is pushed, acknowledged, and its new values pulled and
        written in a group of chunks at a time before the next shard's.

        Never a whole shard's reply, nor a pulled group beside the encoded push. A shard's part not held
        as folded (a refused push without feedback, a worker count changed since the fold under the barrier, `round_start=
        "shards"`) is filled from the shards, which hold the round's start until every worker pushed.
        A shard that has moved on since the round started makes the round unpushable: its values are
        written in and the next round starts from there.
        """
        start = self.version
        if self._pending != start:
            self._inner_round()
            self._pending, self._sent = start, set()
        done = False
        for s in self.client.shards:
            if s in self._sent:
                continue
            n, chunks = self.ctx.num_workers, self.client.chunks_of_shard(s)
            if not rs.ready(chunks, n, exact=self.barrier):
                res = self.client.pull([s])
                if res.versions[s] != start:
                    self._note_versions(res.versions)
                    self._pending = None
                    rs.clear()
                    return self._assemble(res.values, res.done)
                rs.fill(res.values, n)
                del res
            pseudo = rs.pseudo_gradient(chunks, n)
            try:
                done = self._recorded_push(pseudo, start, functools.partial(_refused, rs, chunks, n),
                                           values=False) or done
            finally:
                del pseudo  # without a compressor nothing empties it: its buffers go before the next shard's
            self._sent.add(s)
            # Acknowledged: the new values come a group of chunks at a time, the push gone (never a shard's reply
            # beside the encoded push).
            for u in self.unpulled:
                done = self._pull_by_group(u) or done
        self._pending = None
        self.rounds += 1
        return done

    def _note_versions(self, versions: dict[int, int]) -> None:
        super()._note_versions({**self.versions, **versions})  # a reply from some shards leaves the others'

    def pull(self) -> bool:
        self._pending = None  # a round exchanged by shard cannot go on (its residuals folded in go with it)
        if self.start is not None:
            self.start.clear()
        return super().pull()

    def _drop_training_state(self) -> None:
        super()._drop_training_state()
        self.inner.state.clear()  # the inner AdamW's two model-sized buffers
        self._pseudo = None
        if self.start is not None:
            self.start.clear()

    def _give_up_round(self) -> None:
        """A stop mid-round: nothing of it leaves this worker. The round's start folded with the residual is not
        theta_0 itself: it is dropped and theta_0 pulled back from the shards (their newer values where they moved
        on; theta_H stays where none answers in time, which none can then be sent)."""
        assert self.start is not None
        self.start.clear()
        self._exchanging = False  # a stop does not abandon this pull
        try:
            res = self.client.pull(timeout_s=min(10.0, self.client.timeout_s))
        except (ShardError, UnavailableError) as e:
            log.warning("stopped mid-round; the round's start could not be pulled back (%s)", e)
            return
        finally:
            self._exchanging = True
        self._note_versions(res.versions)
        self._assemble(res.values, res.done)

    def _inner_round(self) -> dict[int, torch.Tensor]:
        """H inner steps from the current (global) parameters; returns theta_0 - theta_H by chunk index
        (nothing where `start` holds the round's start: its exchange takes it there).

        With fsdp or pipeline the inner optimizer steps each rank's own shard or stage, and
        the pseudo-gradient is of this rank's chunks only. A stop request waits for the end
        of the round there: abandoning alone would leave the other local ranks in a collective.
        """
        theta0 = None
        if self.start is not None:
            self.start.begin(self.ctx.num_workers)
        else:
            theta0 = self.layout.snapshot()
        for i in range(self.exp.inner_steps):
            if self.layout.holds_full_model and self.should_stop():
                if theta0 is not None:
                    self.layout.restore(theta0)  # nothing of the round leaves this worker
                else:
                    self._give_up_round()
                raise StepAbandoned
            schedule_lr(self.inner, self.exp, self.progress + i)  # before backward: it may step inside
            with self.profiler.region("compute"), self._stepping():
                _, node_samples, compute_s = self._local_grad(self.client.fault_ctx)
            self.compute_s += compute_s
            if not self.step_ok:  # fp16 overflow: this inner step is skipped
                self.skipped_steps += 1
                continue
            if self.stepper is None:
                self.inner.step()
            self.layout.params_stepped()
            self._count(node_samples)
        # The gradient is not needed again before the next round's first backward: free it for the
        # exchange, where the reply and the pseudo-gradient are held instead.
        self.layout.release_gradients()
        return {} if theta0 is None else self.layout.chunk_delta(theta0)

    def _stepping(self) -> contextlib.AbstractContextManager[Any]:
        """Around backward: the inner step runs inside it, parameter by parameter (`StepInBackward`)."""
        return self.stepper.armed() if self.stepper is not None else contextlib.nullcontext()

    def _report(self, rate: float) -> None:
        self.on_metrics(self.progress, {"outer_rounds": float(self.rounds)})
        super()._report(rate)


def _refused(rs: RoundStart, chunks: list[int], n: int, recorded: dict[int, Any]) -> None:
    """A by-shard push refused whole: its chunks' round start is rebuilt (`RoundStart.refused`)."""
    rs.refused(chunks, n)


def _scale(chunks: dict[int, torch.Tensor], factor: float) -> None:
    """Multiply every chunk in place (in a frame of its own: no loop variable keeps a chunk alive after)."""
    for d in chunks.values():
        d.mul_(factor)
