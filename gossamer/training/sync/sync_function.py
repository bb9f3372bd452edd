"""sync around a train function, as torch DDP: each backward pass ends with the workers' mean gradient in `.grad`."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gossamer.core.errors import ConfigError, ShardError
from gossamer.core.faults import die_at, gate_at
from gossamer.engine.rank import StepAbandoned
from gossamer.paramserver import PullResult
from gossamer.training.shards.shard_function import ShardFunctionTrainer
from gossamer.transport.router import FAILED_PRECONDITION, REFORM

__all__ = ["SyncFunctionTrainer"]


class SyncFunctionTrainer(ShardFunctionTrainer):
    """A train function's sync, as torch DDP: every backward pass ends with the workers' mean gradient in `.grad`.

    Each parameter's post-accumulate-grad hook queues one callback at the end of the backward pass, which pushes
    this worker's accumulated gradients to the shards under the barrier and writes the round's mean back into
    every `.grad` before `backward()` returns; the user's clipping and optimizer then see the mean, as one process
    would over all the workers' samples, and every worker takes the same step. Each push carries the parameters
    too, which the shards hold as the run's (for checkpoints and workers that join). `total_steps` counts the
    user's `optimizer.step()` calls; a shard version is one exchange.
    """

    keeps_basis = False  # the parameters go with each push
    exchanges_in_backward = True

    def start(self) -> None:
        """Register with the shards and take the run's parameters and step count (those of its last exchange)."""
        self._chunk_pieces: dict[int, list[tuple[torch.Tensor, int, int, int]]] = {}
        self.client.hello(fresh=True)
        self.pull()
        self.clock = self._node_max(max(self.client.steps.values(), default=0))  # a joiner counts on from there
        self.done = self.clock >= self.exp.total_steps
        self._exchanging = True

    def _backward_ended(self) -> None:
        """End of a backward pass: the node's mean (several local ranks), then the round's mean of the workers'."""
        self._backward_queued = False
        self._node_mean()
        self._exchange_grads()
        self._mean_taken = True

    def _exchange_grads(self) -> None:
        """End of a backward pass: the round's mean gradient into every `.grad` (the same bits on every worker)."""
        res = self._round()
        if self.ctx.local_world > 1:  # each local rank pushed its share of the chunks: the others' come from them
            mean = torch.zeros(self.plan.total_numel)
            for idx, v in res.values.items():
                c = self.plan.chunks[idx]
                mean[c.flat_offset:c.flat_offset + c.numel] = v.reshape(-1)
            dist.all_reduce(mean)
            res.values.update({c.index: mean[c.flat_offset:c.flat_offset + c.numel] for c in self.plan.chunks})
        with torch.no_grad():
            for idx, v in res.values.items():
                flat = v.reshape(-1)
                for p, start, count, at in self._pieces(idx):
                    piece = flat[at:at + count]
                    if p.grad is None:
                        if not bool(piece.any()):
                            continue  # none of the workers' gradients reached it (yet): left None
                        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if p.grad.is_contiguous():
                        p.grad.view(-1)[start:start + count].copy_(piece)
                    else:  # a gradient in another layout (channels_last): through a contiguous copy
                        whole = p.grad.contiguous()
                        whole.view(-1)[start:start + count].copy_(piece)
                        p.grad.copy_(whole)

    def _pieces(self, idx: int) -> list[tuple[torch.Tensor, int, int, int]]:
        """Chunk `idx`'s flat range as pieces of the parameters: (parameter, its first element there, how many,
        where in the chunk), so the push is written from the parameters and the mean into their `.grad` without
        a flat copy of the whole model on the way."""
        pieces = self._chunk_pieces.get(idx)
        if pieces is None:
            c = self.plan.chunks[idx]
            pieces, offset = [], 0
            for p in self._params:
                lo, hi = max(offset, c.flat_offset), min(offset + p.numel(), c.flat_offset + c.numel)
                if lo < hi:
                    pieces.append((p, lo - offset, hi - lo, lo - c.flat_offset))
                offset += p.numel()
            self._chunk_pieces[idx] = pieces
        return pieces

    def _push_of(self, idle: bool) -> dict[int, torch.Tensor]:
        """This rank's chunks as a round pushes each: its gradient (zero where idle, or for a parameter without
        one), then its values, each written once from the parameters into the chunk's buffer."""
        push: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for c in self.mine:
                buf = torch.empty(2 * c.numel)
                for p, start, count, at in self._pieces(c.index):
                    grad = buf[at:at + count]
                    if idle or p.grad is None:
                        grad.zero_()
                    else:
                        grad.copy_(p.grad.reshape(-1)[start:start + count])
                    buf[c.numel + at:c.numel + at + count].copy_(p.reshape(-1)[start:start + count])
                push[c.index] = buf
        return push

    def _round(self, *, idle: bool = False) -> PullResult:
        """One exchange under the barrier: this rank's gradients (none where `idle`) and parameters pushed, the
        shards' answer."""
        self._apply_updates()
        push = self._push_of(idle)
        gate_at("push", step=self.progress, **self.client.fault_ctx)
        die_at("mid-push", step=self.clock, **self.client.fault_ctx)
        t0 = time.perf_counter()
        with self.profiler.region("communication"):
            res = self._push_round(push, idle=idle)
        self.exchange_s += time.perf_counter() - t0
        self._note_versions(res.versions)
        return res

    def _push_round(self, push: dict[int, torch.Tensor], *, idle: bool) -> PullResult:
        """The push under the barrier, again where it re-formed or the shards moved on (the same gradient)."""
        for attempt in range(100):
            generation = self.ctx.generation
            try:
                res = self.client.push_pull(push, clock=self.clock, basis=self.versions, step=self.version,
                                            num_workers=self.ctx.num_workers, generation=generation, values=False,
                                            idle=idle)
                break
            except ShardError as e:  # the barrier re-formed, or the shards moved on: the same gradient goes again
                if attempt == 99 or not ({REFORM, FAILED_PRECONDITION} & set(e.codes)):
                    raise
                self.redone += 1
                if REFORM in e.codes:
                    self._await_generation(generation)
                else:
                    time.sleep(0.05 * min(attempt, 10))
                    self._note_versions(self.client.pull().versions)
        return res

    def _node_max(self, value: int) -> int:
        """The largest `value` of the node's local ranks (each talks to the shards of its own chunks)."""
        if self.ctx.local_world == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _hold_place(self) -> None:
        """Done: push idle (the barrier's place, no gradient) for the workers still stepping (one that joined may
        be a backward or a step behind) until a round of idle pushes alone says every worker is done."""
        try:
            while not self._stopping():
                step = self.version
                if not self._node_max(max(self._round(idle=True).versions.values(), default=step) > step):
                    return  # no version made (on any of the node's ranks' shards): every worker is done
        except StepAbandoned:
            self.client.abandon()

    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step on the mean gradient its backward left; counted."""
        if self.done:
            return
        if not self._mean_taken:
            raise ConfigError("train", "in sync optimizer.step() steps on the workers' mean gradient, which the last "
                                       "backward() before it leaves in .grad: none since the previous step ran "
                                       "outside ctx.no_sync()")
        self._apply_updates()
        self._user_stepped(optimizer)
        self._counted_to_clock()
        self._maybe_eval(self.progress)

    @property
    def progress(self) -> int:
        """The user's optimizer steps (every worker takes each one)."""
        return self.clock

    def end(self) -> None:
        """The lead writes its own parameters (the shards hold those of the last exchange, a step before)."""
        self._profile_end()
        self._unwatch_backward()
        if self.done:
            self._hold_place()
        self._exchanging = False
        if self.done:
            self._past_the_end()
            if self._agrees_on_node():
                self._agree(True)  # the node's ranks take the lead flag and the stop together
            self._await_lead()
            if self.ctx.lead and not self._stopping():
                self.finish()
        self.client.leave()
        self.client.close()
        self.finished = self.done
