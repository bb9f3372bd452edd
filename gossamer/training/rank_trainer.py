"""What every mode's local rank does: build the model over its layout, compute the node's gradient, evaluate, checkpoint."""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gossamer.checkpoint.manifest import save_model_checkpoint
from gossamer.checkpoint.sharded import ShardSnapshot, save_shard
from gossamer.core.envinfo import fingerprint
from gossamer.core.faults import die_at
from gossamer.core.modes import mode_of
from gossamer.core.protocol import AssignmentUpdate
from gossamer.engine import sampler
from gossamer.engine.batches import to_device
from gossamer.engine.layout import NodeLayout, rank_layout, shards_model
from gossamer.engine.loader import StepLoader, Want, index_tuple, want_len
from gossamer.engine.model import build, experiment_data, user_metrics
from gossamer.engine.precision import LossScaler, check_precision
from gossamer.engine.profiling import StepProfiler
from gossamer.engine.rank import Hook, RankContext, StepStats
from gossamer.paramserver import ShardPlan

log = logging.getLogger(__name__)

__all__ = ["OnSaved", "RankTrainer"]

#: Told of every checkpoint a trainer wrote: (step, path, kind); the role process registers it.
OnSaved = Callable[[int, str, str], None]


class RankTrainer(abc.ABC):
    """What every mode's local rank does: build the model and data, lay the model over the node's
    local ranks (`layout`: ddp, fsdp or pipeline), compute the node's gradient of this rank's
    samples, evaluate, save checkpoints. A mode's trainer adds how nodes exchange.
    """

    #: Whether this trainer's parameters come from parameter servers at its first pull.
    uses_servers = False

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], AssignmentUpdate | None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_saved: OnSaved | None = None) -> None:
        self.ctx = ctx
        self.exp = ctx.experiment
        self.mode = mode_of(self.exp)
        check_precision(self.exp, ctx.device)
        # Sharded layouts with servers never hold the whole model: it is built on the meta
        # device, each rank allocates its own part, and the first pull fills it in.
        model, self.train_set, self.eval_set = self._build()
        #: The (train, eval) sets as the loop reads them: by index, or by position for streams.
        self.train_data, self.eval_data = experiment_data(self.exp, self.train_set, self.eval_set)
        self.loader = StepLoader(self.train_data, num_workers=self.exp.num_workers, prefetch=self.exp.prefetch)
        # The plan is made from the whole model, before a layout shards or stages it.
        self.plan = ShardPlan.for_experiment(model, self.exp)
        self.layout: NodeLayout = rank_layout(model, self.exp, ctx.local_rank, ctx.local_world, ctx.device)
        self.layout.use_plan(self.plan)
        self.model = self.layout.module
        #: ddp: the whole model as one flat vector (the parameters are views of it); sharded: empty.
        self.flat = self.layout.flat
        self.scaler = LossScaler() if self.exp.precision == "fp16" else None
        self.step_ok = True  # False: the last gradient overflowed in fp16 and must not be applied
        self.skipped_steps = 0
        self.grad_norm = float("nan")
        self.on_metrics = on_metrics or (lambda step, values: None)
        self.on_saved = on_saved or (lambda step, path, kind: None)
        #: Past the last step (not the lead): send this rank's final counters, then tell the
        #: coordinator the role is done; the run completes once every worker's are in. Set by the role process.
        self.report_final: Callable[[], None] = lambda: None
        self.updates = updates or (lambda: None)
        self.should_stop = should_stop or (lambda: False)
        self.endpoint = ""  # where other nodes reach this rank (a gossip peer), reported to the coordinator
        self.clock = 0
        self.stats = StepStats()
        self._last_eval = 0
        self.final_path = ""
        self.final_metrics: dict[str, float] = {}
        #: The run reached its end (as every local rank agreed), not a stop: all ranks are past their collectives.
        self.finished = False
        self.profiler = StepProfiler(self.exp, experiment_id=ctx.experiment_id, node_id=ctx.node_id,
                                     node_name=ctx.node_name, local_rank=ctx.local_rank, device=ctx.device,
                                     checkpoint_dir=ctx.checkpoint_dir, on_metrics=lambda s, v: self.on_metrics(s, v))

    def _build(self) -> tuple[torch.nn.Module, Any, Any]:
        """The model and the (train, eval) sets, from the experiment's `model` and `dataset`."""
        return build(self.exp, self.ctx.device,
                     meta=shards_model(self.exp, self.ctx.local_world) and self.uses_servers)

    @abc.abstractmethod
    def run(self) -> None:
        """Train to the end or to a stop; each mode's trainer owns its loop."""

    def _params_changed(self) -> None:
        """`flat` was written: copy it into the parameters unless they are views of it."""
        self.layout.params_changed()

    # --- one step ----------------------------------------------------------------------
    def _data_step(self) -> int:
        """The step number that picks this rank's samples: its own step (sync: the global step)."""
        return self.clock

    def _want_at(self, step: int) -> tuple[Want, int]:
        """This rank's samples at `step` under the current membership, and the denominator of the
        node's mean loss. A stream is read by position: this worker's piece of the step's span."""
        if self.train_data.stream:
            return self._span_want(step, self.exp.batch_size * self.ctx.num_workers)
        n = len(self.train_data)
        idx = sampler.async_batch(n, self.exp.batch_size, step, self.exp.seed, self.ctx.worker_index)
        return ("idx", index_tuple(self.layout.rank_share(idx))), idx.numel()

    def _span_want(self, step: int, step_samples: int) -> tuple[Want, int]:
        start, stop = sampler.stream_span(step, step_samples, self.ctx.num_workers, self.ctx.worker_rank)
        mine = self.layout.rank_share(torch.arange(start, stop))
        lo = int(mine[0]) if len(mine) else start
        return ("span", lo, lo + len(mine)), stop - start

    def _local_grad(self, fault_ctx: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Backprop this rank's samples and reduce the gradient inside the node.

        Returns the node's flat gradient where a rank holds the whole model (`p.grad` holds it
        too; sharded layouts: empty, each rank holds its regions' gradient), [samples, summed
        loss per sample] of the node, and the compute seconds.
        """
        t_compute = time.perf_counter()
        step = self._data_step()
        want, denom = self._want_at(step)
        # The step's own samples are known already: only the read-ahead steps are worked out again.
        batch = to_device(self.loader.get(step, lambda s: want if s == step else self._want_at(s)[0]),
                          self.ctx.device)
        grad, node_samples = self.layout.node_gradient(
            batch, denom, want_len(want), self._loss_scale(),
            before_reduce=lambda: die_at("mid-allreduce", step=self.clock, **(fault_ctx or {})))
        # Every rank now holds the node's gradient (or its part of it): unscale, check and clip it alike.
        self.step_ok = True
        if self.scaler is not None:
            self.layout.unscale(self.scaler.scale)
            self.step_ok = self.scaler.update(self.layout.gradient_finite())
        if self.exp.max_grad_norm and self.step_ok:
            self.grad_norm = self.layout.clip_node_gradient(self.exp.max_grad_norm)
        self.layout.gradient_ready()
        if self.ctx.step_delay_s:
            time.sleep(self.ctx.step_delay_s)
        return grad, node_samples, time.perf_counter() - t_compute

    def _loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _apply_updates(self) -> AssignmentUpdate | None:
        """Take in the newest assignment change the node agent passed on (lead, membership)."""
        upd = self.updates()
        if upd is not None:
            self.ctx.lead = upd.lead
            self.ctx.num_workers = max(1, upd.num_workers)
            self.ctx.worker_rank = upd.worker_rank
            self.ctx.generation = max(self.ctx.generation, upd.generation)
        return upd

    def _count(self, node_samples: torch.Tensor) -> None:
        self.clock += 1
        self.stats.steps += 1
        samples, loss_sum = node_samples.tolist()  # one read of the tensor, not three
        self.stats.samples += int(samples)
        self.stats.loss = loss_sum / max(1.0, samples)

    # --- evaluation --------------------------------------------------------------------
    def _evaluate(self, step: int) -> dict[str, float]:
        """Evaluate (every local rank of a sharded layout takes part); local rank 0 reports.

        Gives eval_loss, eval_accuracy (classification), eval_perplexity (language models) and
        the experiment's own `metrics` (where a rank holds the whole model).
        """
        values = self.layout.evaluate(self.eval_data, limit=self.exp.eval_samples)
        if self.layout.holds_full_model:
            values.update(user_metrics(self.exp, self.model, self.eval_set))
        if self.ctx.local_rank == 0:
            self.on_metrics(step, {**values, "eval_step": float(step)})
        return values

    def _evaluates(self) -> bool:
        """Whether this rank takes part in evaluations: the lead's rank 0, or all its ranks when sharded."""
        return self.ctx.lead and (self.ctx.local_rank == 0 or not self.layout.holds_full_model)

    def _maybe_eval(self, step: int) -> None:
        """The lead evaluates every `eval_every` steps of progress."""
        every = self.exp.eval_every
        if self._evaluates() and every and step // every > self._last_eval \
                and step < self.exp.total_steps:
            self._last_eval = step // every
            self._evaluate(step)

    # --- checkpoints -------------------------------------------------------------------
    def checkpoint_path(self, label: str) -> Path:
        return Path(self.ctx.checkpoint_dir) / self.ctx.experiment_id / label

    def _save(self, state: dict[str, torch.Tensor], step: int, kind: str) -> str:
        label = "final" if kind == "final" else f"step-{step:08d}"
        path = save_model_checkpoint(
            self.checkpoint_path(label), state,
            {"experiment_id": self.ctx.experiment_id, "step": step, "kind": kind,
             "experiment": self.exp.to_dict(), "torch": torch.__version__, "env": fingerprint(self.ctx.device)},
        )
        self.on_metrics(step, {"checkpoint_step": float(step)})
        self.on_saved(step, str(path), kind)
        return str(path)

    def _finish_at(self, step: int, extra: dict[str, float] | None = None) -> None:
        """Final eval and final checkpoint of the parameters this rank holds.

        Sharded layouts: every rank writes its own regions (no rank gathers the model) as one
        shard of a sharded checkpoint that `load_checkpoint` reads back as a plain state_dict;
        otherwise local rank 0 writes the whole model.
        """
        if not self.layout.holds_full_model:
            self._finish_sharded(step, extra)
            return
        if self.ctx.local_rank != 0:
            return
        values = self._evaluate(step)
        # save_model_checkpoint copies each tensor once; training is over, nothing writes them meanwhile.
        self.final_path = self._save(self.model.state_dict(), step, "final")
        self.final_metrics = {**values, "steps": float(step), **(extra or {})}
        log.info("final: step %d %s -> %s", step, _figures(values), self.final_path)

    def _finish_sharded(self, step: int, extra: dict[str, float] | None) -> None:
        layout = self.layout
        values = self._evaluate(step)
        snap = ShardSnapshot(
            experiment=self.ctx.experiment_id, step=step, shard=self.ctx.local_rank, num_shards=self.ctx.local_world,
            total_numel=layout.total_numel, version=step,
            pieces={off: {"param": t.float()} for off, t in layout.read_flat().items()},
            layout=[(n, list(shape)) for n, shape in layout.shapes.items()],
            extra={"kind": "final", "parallelism": layout.kind, "env": fingerprint(self.ctx.device)},
        )
        path = save_shard(self.checkpoint_path("final"), snap).parent
        dist.barrier()  # every rank's piece is on disk before rank 0 reports the checkpoint
        if self.ctx.local_rank == 0:
            self.on_metrics(step, {"checkpoint_step": float(step)})
            self.on_saved(step, str(path), "final")
            self.final_path = str(path)
            self.final_metrics = {**values, "steps": float(step), **(extra or {})}
            log.info("final (%s over %d ranks): step %d %s -> %s", layout.kind,
                     self.ctx.local_world, step, _figures(values), path)


def _figures(values: dict[str, float]) -> str:
    return " ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in sorted(values.items()))
