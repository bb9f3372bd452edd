"""The training loop of one local rank: compute, all-reduce inside the node, exchange its slice with the shards."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer._import_check import resolve
from gossamer.checkpoint.manifest import save_model_checkpoint
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.envinfo import fingerprint
from gossamer.errors import ConfigError, ShardError
from gossamer.experiment import Experiment
from gossamer.faults import die_at
from gossamer.paramserver import (
    ShardClient,
    ShardPlan,
    flatten_grads,
    flatten_params,
    unflatten_into,
)
from gossamer.transport.throttle import TokenBucket
from gossamer.worker import sampler
from gossamer.worker.adaptive_link import AdaptiveLink
from gossamer.worker.layout import NodeLayout, Region, loss_sum, make_layout, stack_batch
from gossamer.worker.precision import LossScaler, check_precision
from gossamer.worker.profiling import StepProfiler

log = logging.getLogger(__name__)


@dataclass
class RankContext:
    """Where this rank sits: experiment, worker index, local rank, shard endpoints, lead flag."""

    experiment_id: str
    experiment: Experiment
    node_id: str
    worker_index: int
    num_workers: int
    endpoints: dict[int, str]
    checkpoint_dir: str
    lead: bool = False
    local_rank: int = 0
    local_world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step_delay_s: float = 0.0  # injected slowness (GOSSAMER_FAULT=delay:...), for tests
    throttle: TokenBucket | None = None  # emulated slow link (GOSSAMER_FAULT=bandwidth:...)
    worker_rank: int = -1  # position among the current workers (sync batch split); -1: worker_index
    generation: int = 0  # the experiment's membership generation this rank last heard of
    node_name: str = ""  # the node's name (profile directories, `profile_nodes`); "" = node_id

    def __post_init__(self) -> None:
        if self.worker_rank < 0:
            self.worker_rank = self.worker_index


@dataclass
class StepStats:
    steps: int = 0
    samples: int = 0
    loss: float = float("nan")
    version: int = 0
    samples_per_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0


Hook = Callable[[int, dict[str, float]], None]


def build(exp: Experiment, device: torch.device, *, meta: bool = False) -> tuple[nn.Module, Any, Any]:
    """Model (seeded, so every process builds identical initial parameters) and (train, eval) data.

    `meta=True` builds the model on the meta device (shapes only, no memory) when it has no
    buffers: a sharded layout then allocates only its own part, and the values come from
    the parameter servers at the first pull. A model with buffers (batch-norm statistics,
    which the servers do not hold) is built for real.
    """
    torch.manual_seed(exp.seed)
    if meta:
        with torch.device("meta"):
            shape_only = resolve(exp.model)(**exp.model_args)  # type: ignore[operator]
        if not any(True for _ in shape_only.buffers()):
            train, evalset = resolve(exp.dataset)(**exp.dataset_args)  # type: ignore[operator]
            return shape_only, train, evalset
        torch.manual_seed(exp.seed)
    model = resolve(exp.model)(**exp.model_args).to(device)  # type: ignore[operator]
    train, evalset = resolve(exp.dataset)(**exp.dataset_args)  # type: ignore[operator]
    return model, train, evalset


def _unflatten_grads(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        n = p.numel()
        if p.grad is not None:
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


@torch.no_grad()
def evaluate(model: nn.Module, ds: Any, device: torch.device, batch: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over a whole dataset, per prediction (per token for sequences)."""
    model.eval()
    correct, loss, count, n = 0, 0.0, 0, len(ds)
    for start in range(0, n, batch):
        x, y = stack_batch(ds, torch.arange(start, min(n, start + batch)))
        out = model(x.to(device))
        total, k = loss_sum(out, y.to(device))
        loss += total.item()
        count += k
        correct += (out.argmax(-1).cpu() == y).sum().item()
    model.train()
    return correct / max(1, count), loss / max(1, count)


class _Abandoned(Exception):
    """A stop was requested while waiting on the shards: the step is given up."""


class RankTrainer:
    """What every mode's local rank does: build the model and data, compute a gradient over
    this rank's samples and all-reduce it inside the node, evaluate, save checkpoints.

    Parameters and gradients are views of two flat fp32 buffers (`flat`, `flat_grad`), so
    exchanging the whole model, or a slice of it, with other nodes needs no copies.
    """

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], dict[str, Any] | None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.ctx = ctx
        self.exp = ctx.experiment
        check_precision(self.exp, ctx.device)
        sharded = self.exp.parallelism != "ddp" and ctx.local_world > 1
        # Sharded layouts with servers never hold the whole model: it is built on the meta
        # device, each rank allocates its own part, and the first pull fills it in.
        self.model, self.train_set, self.eval_set = build(self.exp, ctx.device, meta=sharded and self.uses_servers)
        # The plan is made from the whole model, before a layout shards or stages it.
        self.plan = ShardPlan.for_experiment(self.model, self.exp)
        self.layout: NodeLayout | None = None
        if sharded:
            self.layout = make_layout(self.model, self.exp, ctx.local_rank, ctx.local_world, ctx.device)
            self.model = self.layout.module
        self.scaler = LossScaler() if self.exp.precision == "fp16" else None
        self.step_ok = True  # False: the last gradient overflowed in fp16 and must not be applied
        self.skipped_steps = 0
        self.grad_norm = float("nan")
        self.on_metrics = on_metrics or (lambda step, values: None)
        self.flush_metrics: Callable[[], None] = lambda: None  # the role process sets the reporter's flush
        self.updates = updates or (lambda: None)
        self.should_stop = should_stop or (lambda: False)
        # ddp: the whole model as one flat vector; sharded layouts hold only their regions.
        self.flat = flatten_params(self.model).to(ctx.device) if self.layout is None else torch.zeros(0)
        self.flat_grad: torch.Tensor | None = None
        if self.layout is None:
            self._bind_flat()
        self.clock = 0
        self.stats = StepStats()
        self._last_eval = 0
        self.final_path = ""
        self.final_metrics: dict[str, float] = {}
        self.profiler = StepProfiler(self.exp, experiment_id=ctx.experiment_id, node_id=ctx.node_id,
                                     node_name=ctx.node_name, local_rank=ctx.local_rank, device=ctx.device,
                                     checkpoint_dir=ctx.checkpoint_dir, on_metrics=lambda s, v: self.on_metrics(s, v))

    #: Whether this trainer's parameters come from parameter servers at its first pull.
    uses_servers = False

    def _bind_flat(self) -> None:
        """Make parameters and gradients views of two flat fp32 buffers (as DDP buckets do).

        Fresh values are then written straight into the parameters and the gradient is
        already flat after backward: no per-step flatten/unflatten copies.
        """
        params = [p for _, p in self.model.named_parameters()]
        if not params or any(p.dtype != torch.float32 for p in params):
            return  # mixed dtypes: keep the copying path
        self.flat_grad = torch.zeros_like(self.flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.flat[offset : offset + n].view_as(p)
            p.grad = self.flat_grad[offset : offset + n].view_as(p)
            offset += n

    def _grads_are_views(self) -> bool:
        if self.flat_grad is None:
            return False
        base = self.flat_grad.untyped_storage().data_ptr()
        return all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() == base for p in self.model.parameters()
        )

    def _params_changed(self) -> None:
        """`flat` was written: copy it into the parameters unless they are views of it."""
        if self.flat_grad is None:
            unflatten_into(self.model, self.flat)

    def _batch(self) -> tuple[torch.Tensor, int]:
        """This rank's sample indices for the step and the denominator of the mean loss."""
        n = len(self.train_set)
        idx = sampler.async_batch(n, self.exp.batch_size, self.clock, self.exp.seed, self.ctx.worker_index)
        return self._rank_share(idx), idx.numel()

    def _rank_share(self, idx: torch.Tensor) -> torch.Tensor:
        """This local rank's samples of the node batch (a pipeline stage sees all of them)."""
        if self.layout is not None and self.layout.kind == "pipeline":
            return idx
        return sampler.even_split(idx, self.ctx.local_world, self.ctx.local_rank)

    def _local_grad(self, fault_ctx: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Backprop this rank's samples and all-reduce inside the node.

        Returns the node's flat gradient (the mean over the node's samples; `p.grad` holds
        it too), [samples, summed loss per sample] of the node, and the compute seconds.
        """
        t_compute = time.perf_counter()
        idx, denom = self._batch()
        x, y = stack_batch(self.train_set, idx)
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        if self.layout is not None:
            return self._sharded_grad(x, y, denom, idx.numel(), t_compute, fault_ctx)
        self.model.zero_grad(set_to_none=False)
        with self._autocast():
            out = self.model(x)
        total, predictions = loss_sum(out.float(), y)
        per_sample = max(1, predictions // max(1, y.shape[0]))  # 1 for classifiers, T for sequences
        (total * (self._loss_scale() / (denom * per_sample))).backward()
        if self.clock == 0 and self.flat_grad is not None and not self._grads_are_views():
            # Checked once: autograd accumulates in place into an existing .grad, so if the
            # first backward kept the views, later ones do too.
            self.flat_grad = None  # autograd replaced a .grad: fall back to copying
            unflatten_into(self.model, self.flat)
        grad = self.flat_grad if self.flat_grad is not None else flatten_grads(self.model)
        node_samples = torch.tensor([float(idx.numel()), total.item() / per_sample])
        if self.ctx.local_world > 1:
            die_at("mid-allreduce", step=self.clock, **(fault_ctx or {}))
            dist.all_reduce(grad)
            dist.all_reduce(node_samples)
        # Every rank now holds the node's gradient: unscale, check and clip it alike.
        self.step_ok = True
        if self.scaler is not None:
            grad.div_(self.scaler.scale)
            self.step_ok = self.scaler.update(bool(torch.isfinite(grad).all()))
        if self.exp.max_grad_norm and self.step_ok:
            self.grad_norm = float(grad.double().norm())
            if self.grad_norm > self.exp.max_grad_norm:
                grad.mul_(self.exp.max_grad_norm / (self.grad_norm + 1e-6))
        if self.flat_grad is None and (self.ctx.local_world > 1 or self.scaler or self.exp.max_grad_norm):
            _unflatten_grads(self.model, grad)
        if self.ctx.step_delay_s:
            time.sleep(self.ctx.step_delay_s)
        return grad, node_samples, time.perf_counter() - t_compute

    def _autocast(self) -> Any:
        """bf16/fp16 autocast of the forward pass (a no-op in fp32)."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.exp.precision)
        return torch.autocast(self.ctx.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def _loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _sharded_grad(self, x: torch.Tensor, y: torch.Tensor, denom: int, samples: int, t_compute: float,
                      fault_ctx: dict[str, int] | None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """FSDP / pipeline: each rank ends with the node gradient of its own regions only."""
        assert self.layout is not None
        layout = self.layout
        layout.zero_grad()
        per_sample = max(1, y[0].numel()) if y.dim() > 1 else 1
        die_at("mid-allreduce", step=self.clock, **(fault_ctx or {}))
        total, _ = layout.forward_backward(x, y, denom * per_sample, self._loss_scale())
        node_samples = torch.tensor([float(samples), total / per_sample])
        if layout.kind == "fsdp":  # each rank had its own samples; a pipeline stage saw them all
            dist.all_reduce(node_samples)
        self.step_ok = True
        if self.scaler is not None:
            for r in layout.regions:
                g = r.grad()
                if g is not None:
                    g.div_(self.scaler.scale)
            self.step_ok = self.scaler.update(layout.all_finite())
        if self.exp.max_grad_norm and self.step_ok:
            self.grad_norm = layout.clip_gradients(self.exp.max_grad_norm)
        if self.ctx.step_delay_s:
            time.sleep(self.ctx.step_delay_s)
        return torch.zeros(0), node_samples, time.perf_counter() - t_compute

    def _apply_updates(self) -> dict[str, Any] | None:
        """Take in the newest assignment change the node agent passed on (lead, membership)."""
        upd = self.updates()
        if upd:
            self.ctx.lead = bool(upd.get("lead", self.ctx.lead))
            self.ctx.num_workers = max(1, int(upd.get("num_workers", self.ctx.num_workers)))
            self.ctx.worker_rank = int(upd.get("worker_rank", self.ctx.worker_rank))
            self.ctx.generation = max(self.ctx.generation, int(upd.get("generation", self.ctx.generation)))
        return upd

    def _count(self, node_samples: torch.Tensor) -> None:
        self.clock += 1
        self.stats.steps += 1
        self.stats.samples += int(node_samples[0].item())
        self.stats.loss = node_samples[1].item() / max(1.0, node_samples[0].item())

    def _evaluate(self, step: int) -> tuple[float, float]:
        """Evaluate (every local rank of a sharded layout takes part); local rank 0 reports."""
        if self.layout is not None:
            acc, loss = self.layout.evaluate(self.eval_set)
        else:
            acc, loss = evaluate(self.model, self.eval_set, self.ctx.device)
        if self.ctx.local_rank == 0:
            self.on_metrics(step, {"eval_accuracy": acc, "eval_loss": loss, "eval_step": float(step)})
        return acc, loss

    def _evaluates(self) -> bool:
        """Whether this rank takes part in evaluations: the lead's rank 0, or all its ranks when sharded."""
        if self.layout is not None:
            return self.ctx.lead
        return self.ctx.lead and self.ctx.local_rank == 0

    def _maybe_eval(self, step: int) -> None:
        """The lead evaluates every `eval_every` steps of progress."""
        every = self.exp.eval_every
        if self._evaluates() and every and step // every > self._last_eval \
                and step < self.exp.total_steps:
            self._last_eval = step // every
            self._evaluate(step)

    def _finish_sharded(self, step: int, extra: dict[str, float] | None) -> None:
        from gossamer.checkpoint.sharded import ShardSnapshot, save_shard

        assert self.layout is not None
        layout = self.layout
        acc, loss = self._evaluate(step)
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
            self.saved(step, str(path), "final")
            self.final_path = str(path)
            self.final_metrics = {"eval_accuracy": acc, "eval_loss": loss, "steps": float(step), **(extra or {})}
            log.info("final (%s over %d ranks): step %d eval accuracy %.4f loss %.4f -> %s", layout.kind,
                     self.ctx.local_world, step, acc, loss, path)

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
        self.saved(step, str(path), kind)
        return str(path)

    def saved(self, step: int, path: str, kind: str) -> None:
        """Hook: a checkpoint was written (the role process registers it with the coordinator)."""

    def _finish_at(self, step: int, extra: dict[str, float] | None = None) -> None:
        """Final eval and final checkpoint of the parameters this rank holds (local rank 0).

        Sharded layouts: every rank writes its own regions (no rank gathers the model) as one
        shard of a sharded checkpoint that `load_checkpoint` reads back as a plain state_dict.
        """
        if self.layout is not None:
            self._finish_sharded(step, extra)
            return
        if self.ctx.local_rank != 0:
            return
        acc, loss = self._evaluate(step)
        self.final_path = self._save(
            {k: t.detach().cpu().clone() for k, t in self.model.state_dict().items()}, step, "final"
        )
        self.final_metrics = {"eval_accuracy": acc, "eval_loss": loss, "steps": float(step), **(extra or {})}
        log.info("final: step %d eval accuracy %.4f loss %.4f -> %s", step, acc, loss, self.final_path)


class Trainer(RankTrainer):
    """One local rank of a worker node, exchanging with parameter-server shards.

    Every step: pick this rank's samples, backprop sum(loss)/denominator, all-reduce the
    gradient inside the node (gloo/NCCL), push this rank's chunks to their shards and get
    the new values back, then re-assemble the full parameters inside the node.
    """

    uses_servers = True

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], dict[str, Any] | None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop)
        # ddp: a balanced share of every chunk; fsdp/pipeline: exactly the chunks of this rank's regions.
        self._slots = self._chunk_slots() if self.layout is not None else {}
        self.mine = [self.plan.chunks[i] for i in sorted(self._slots)] if self.layout is not None \
            else self.plan.chunks_of_rank(ctx.local_rank, ctx.local_world)
        shapes = dict(self.layout.shapes) if self.layout is not None \
            else {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        compressor = None
        if self.exp.compression not in ("none", "adaptive") or self.exp.compression_overrides:
            compressor = ChunkCompressor(
                "none" if self.exp.compression == "adaptive" else self.exp.compression,
                self.plan,
                overrides=list(self.exp.compression_overrides.items()),
                shapes=shapes,
                seed=self.exp.seed * 1000 + ctx.worker_index,
            )
        self.client = ShardClient(
            experiment=ctx.experiment_id,
            sender=f"{ctx.node_id}:{ctx.worker_index}",
            plan=self.plan,
            endpoints=ctx.endpoints,
            chunks=[c.index for c in self.mine],
            compressor=compressor,
            pull_codec=self.exp.pull_compression,
            throttle=ctx.throttle,
        )
        self.adaptive: AdaptiveLink | None = None
        if self.exp.compression == "adaptive" and self.mine:
            self.adaptive = AdaptiveLink(self.client, self.plan, shapes,
                                         target_share=self.exp.adaptive_target_share,
                                         seed=self.exp.seed * 1000 + ctx.worker_index)
        self.client.on_wait = self._on_wait  # new endpoints reach a waiting request
        self.profiler.watch(self.client.compressor, "encode", "decode")
        self.profiler.watch(getattr(self.client, "_pull_decoder", None), "decode")
        self.client.fault_ctx = {"worker": ctx.worker_index, "rank": ctx.local_rank}
        self.versions: dict[int, int] = {}
        self.periodic_model_checkpoints = False
        self._exchanging = False
        self.redone = 0  # sync steps computed again after the barrier re-formed
        self.versions_lost = 0
        self._last_ckpt = 0
        self._ckpt_thread: threading.Thread | None = None
        self._node_progress = 0  # sharded: the step every local rank agreed on at the last exchange
        self._node_stop = False

    # --- parameter exchange ------------------------------------------------------------
    def _chunk_slots(self) -> dict[int, tuple[Region, int]]:
        """Which plan chunk lies where in this rank's regions: chunk index -> (region, offset in it).

        Raises:
            ConfigError: a region is not made of whole chunks (the plan was cut for another layout).
        """
        assert self.layout is not None
        by_start = {c.flat_offset: c for c in self.plan.chunks}
        slots: dict[int, tuple[Region, int]] = {}
        for r in self.layout.regions:
            pos, end = r.flat_offset, r.flat_offset + r.numel
            while pos < end:
                c = by_start.get(pos)
                if c is None or pos + c.numel > end:
                    raise ConfigError("parallelism", f"{self.layout.kind} rank {self.ctx.local_rank} of "
                                      f"{self.ctx.local_world} holds {r.name} [{r.flat_offset}, {end}) of the flat "
                                      "vector, which is not made of whole chunks of the parameter-server plan")
                slots[c.index] = (r, pos - r.flat_offset)
                pos += c.numel
        return slots

    def _own_values(self) -> dict[int, torch.Tensor]:
        """Copies of the current values of this rank's chunks (sharded layouts), by chunk index."""
        out: dict[int, torch.Tensor] = {}
        for idx, (r, start) in self._slots.items():
            out[idx] = r.local()[start : start + self.plan.chunks[idx].numel].detach().cpu().clone()
        return out

    def _region_grads(self) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for idx, (r, start) in self._slots.items():
            n = self.plan.chunks[idx].numel
            g = r.grad()
            out[idx] = g[start : start + n].cpu() if g is not None else torch.zeros(n)
        return out

    def _agree(self, done: bool) -> bool:
        """Sharded layouts: every local rank adopts the same end flag, progress and lead flag.

        Ranks talk to different shards, so their views of progress differ by a step or so;
        evaluations and the end are collective and must be decided alike on every rank.
        """
        version = -float(self.version) if self.versions else -float("inf")  # no chunks: no say
        flags = torch.tensor([float(done), version, float(self.ctx.lead), float(self.should_stop())],
                             dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._node_progress = max(0, int(-flags[1])) if math.isfinite(float(flags[1])) else 0
        self.ctx.lead = bool(flags[2] > 0)
        self._node_stop = bool(flags[3] > 0)  # SIGTERM reached one rank: the node stops together
        return bool(flags[0] > 0)
    def _assemble(self, values: dict[int, torch.Tensor], done: bool) -> bool:
        """Make every local rank hold the full parameters, given this rank's fresh chunks.

        Returns `done` agreed by all local ranks: one rank's shards may report the end a
        step before another's, and a rank that stopped alone would leave the others in
        their next collective. The flag rides in the same all-reduce as the parameters.
        """
        if self.layout is not None:
            for idx, v in values.items():
                r, start = self._slots[idx]
                r.local()[start : start + v.numel()].copy_(v.reshape(-1).to(self.ctx.device))
            return self._agree(done)
        if self.ctx.local_world == 1:
            self.plan.scatter(self.flat, values)
        else:
            buf = torch.zeros(self.flat.numel() + 1, dtype=self.flat.dtype, device=self.flat.device)
            self.plan.scatter(buf[:-1], {k: v.to(buf.device) for k, v in values.items()})
            buf[-1] = float(done)
            dist.all_reduce(buf)  # chunks are disjoint across ranks: the sum is a gather
            self.flat.copy_(buf[:-1])
            done = bool(buf[-1].item() > 0)
        self._params_changed()
        return done

    def pull(self) -> bool:
        res = self.client.pull()
        self._note_versions(res.versions)
        return self._assemble(res.values, res.done)

    def _note_versions(self, versions: dict[int, int]) -> None:
        """Keep shard versions; a shard that went backwards was restored from a checkpoint."""
        for s, v in versions.items():
            old = self.versions.get(s)
            if old is not None and v < old:
                log.warning("shard %d went back from version %d to %d (restored from a checkpoint)", s, old, v)
                self.versions_lost += old - v
        self.versions = dict(versions)

    @property
    def version(self) -> int:
        return min(self.versions.values()) if self.versions else 0

    @property
    def progress(self) -> int:
        """Steps done by the experiment, as compared with `total_steps` and `eval_every`."""
        return self._node_progress if self.layout is not None else self.version

    @property
    def barrier(self) -> bool:
        """The shards wait for every current worker's update (the step is redone on REFORM)."""
        return self.exp.mode == "sync"

    # --- one step ----------------------------------------------------------------------
    def _batch(self) -> tuple[torch.Tensor, int]:
        if self.exp.mode != "sync":
            return super()._batch()
        g = self.exp.effective_global_batch(self.ctx.num_workers)
        idx = sampler.sync_global_batch(len(self.train_set), g, self.version, self.exp.seed)
        idx = sampler.even_split(idx, self.ctx.num_workers, self.ctx.worker_rank)
        return self._rank_share(idx), g

    def step(self) -> bool:
        """One training step; True when the experiment has reached total_steps.

        Sync mode: when the barrier re-forms (a worker lost or joined) the shards answer
        REFORM and the step is computed again over the new membership. With
        `global_batch_size` set the global batch of the step is the same samples whatever
        the number of workers; otherwise each worker keeps `batch_size`.
        """
        for attempt in range(100):
            generation = self.ctx.generation
            try:
                return self._step_once()
            except ShardError as e:
                if not self.barrier:
                    raise
                if "REFORM" in e.codes:
                    self._await_generation(generation)
                elif "FAILED_PRECONDITION" in e.codes and attempt < 99:
                    log.info("shards moved on or rolled back (%s); pulling and redoing the step", e)
                    time.sleep(0.05 * min(attempt, 10))
                    self.pull()
                else:
                    raise
                self.redone += 1
        raise RuntimeError("the sync step could not be completed after 100 attempts")

    def _await_generation(self, old: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ctx.generation <= old and time.monotonic() < deadline and not self.should_stop():
            self._apply_updates()
            time.sleep(0.02)
        log.info("worker %d: barrier re-formed (generation %d -> %d, %d workers); redoing the step",
                 self.ctx.worker_index, old, self.ctx.generation, self.ctx.num_workers)

    def _step_once(self) -> bool:
        with self.profiler.region("compute"):
            grad, node_samples, compute_s = self._local_grad(self.client.fault_ctx)
        if not self.step_ok:  # fp16 overflow: nothing is pushed, the scale went down, the batch is redone
            self.skipped_steps += 1
            return self.pull()
        if self.layout is not None:
            grads = self._region_grads()
        else:
            grads = {c.index: grad[c.flat_offset : c.flat_offset + c.numel].cpu() for c in self.mine}
        if self.exp.overlap:
            done = self._exchange_overlapped(grads, compute_s)
        else:
            sync = self.exp.mode == "sync"
            sent0, t_exchange = self.client.bytes_up, time.perf_counter()
            die_at("mid-push", step=self.clock, **self.client.fault_ctx)
            self.client.fault_step = self.clock
            with self.profiler.region("communication"):
                res = self.client.push_pull(
                    grads,
                    clock=self.clock,
                    basis=self.versions,
                    step=self.version if sync else None,
                    num_workers=self.ctx.num_workers if sync else None,
                    generation=self.ctx.generation if sync else None,
                )
            self._note_versions(res.versions)
            done = self._assemble(res.values, res.done)
            if self.adaptive is not None:
                self.adaptive.after_step(compute_s, self.client.bytes_up - sent0, time.perf_counter() - t_exchange)
        self._count(node_samples)
        return done

    def _exchange_overlapped(self, grads: dict[int, torch.Tensor], compute_s: float) -> bool:
        """Async with `overlap`: this step's gradient leaves while the next one is computed.

        The gradient just computed is pushed once the reply to the previous push is in, so
        the round trip hides behind compute; every update is one step staler than without.
        """
        basis = dict(self.versions)  # what this gradient was computed on
        done = False
        if self.client.in_flight:
            with self.profiler.region("communication"):
                res = self.client.wait()
            self._note_versions(res.versions)
            done = self._assemble(res.values, res.done)
        if self.adaptive is not None:
            self.adaptive.after_step(compute_s)
        if not done:
            with self.profiler.region("communication"):
                self.client.push_async(grads, clock=self.clock, basis=basis)
        return done

    # --- whole run ---------------------------------------------------------------------
    def run(self) -> None:
        """Train until the shards report total_steps; the lead then evaluates and checkpoints."""
        self.client.hello(fresh=True)
        done = self.pull()
        t_report, t0, samples0 = time.monotonic(), time.monotonic(), 0
        self._exchanging = True
        while not done and not self._stopping():
            self._apply_updates()
            self.profiler.step(self.clock)
            try:
                done = self.step()
            except _Abandoned:
                # SIGTERM while waiting on the shards: give the step up. A push is one message
                # per shard, applied whole or not at all; a part of a multi-rank update left
                # alone is discarded by the shard when this worker LEAVEs.
                log.info("worker %d rank %d: stop requested mid-exchange; step abandoned",
                         self.ctx.worker_index, self.ctx.local_rank)
                self.client.abandon()
                break
            now = time.monotonic()
            if now - t_report >= 1.0 or done:
                rate = (self.stats.samples - samples0) / max(1e-9, now - t_report)
                t_report, samples0 = now, self.stats.samples
                self._report(rate)
            self._maybe_eval_and_checkpoint()
        self.profiler.close(self.clock)
        self._exchanging = False
        if self.client.in_flight:
            if self.should_stop():
                self.client.abandon()
            else:
                self.client.wait()  # stopped mid-overlap: collect the last reply
        if self._ckpt_thread is not None:
            self._ckpt_thread.join()
        if done:
            self._apply_updates()
            if self.layout is not None:
                self._agree(True)  # every rank of the node agrees on the lead flag, then on the finish
            if self.ctx.lead:
                self.pull()  # the final parameters, whoever pushed last
                self.finish()
        self.client.leave()
        self.client.close()
        log.info("worker %d rank %d finished after %d steps (%.1f s)", self.ctx.worker_index,
                 self.ctx.local_rank, self.stats.steps, time.monotonic() - t0)

    def _stopping(self) -> bool:
        """ddp: this rank's stop flag; sharded layouts: the flag the node's ranks agreed on."""
        return self._node_stop if self.layout is not None else self.should_stop()

    def _on_wait(self) -> None:
        self._apply_updates()
        # Sharded layouts never abandon a step alone: the other ranks would wait in a collective.
        if self._exchanging and self.layout is None and self.should_stop():
            raise _Abandoned

    def _apply_updates(self) -> dict[str, Any] | None:
        upd = super()._apply_updates()
        if upd and upd.get("endpoints"):
            self.client.set_endpoints({int(k): v for k, v in upd["endpoints"].items()})
        return upd

    def _report(self, rate: float) -> None:
        c = self.client
        values = {
            "bytes_up": float(c.bytes_up),
            "bytes_down": float(c.bytes_down),
            "raw_bytes_up": float(c.raw_bytes_up),
            "raw_bytes_down": float(c.raw_bytes_down),
            "resent": float(c.resent),
            "redone_steps": float(self.redone),
        }
        if self.skipped_steps or self.scaler is not None:
            values["skipped_steps"] = float(self.skipped_steps)
            values["loss_scale"] = self._loss_scale()
        if self.exp.max_grad_norm:
            values["grad_norm"] = self.grad_norm
        if c.compressor is not None:
            values["encode_s"] = c.compressor.encode_seconds
        if self.adaptive is not None:
            values.update(self.adaptive.metrics())
        if self.ctx.local_rank == 0:
            values.update(
                loss=self.stats.loss, samples=float(self.stats.samples), samples_per_s=rate,
                updates=float(self.stats.steps), version=float(self.version),
            )
        self.on_metrics(self.progress, values)

    def _maybe_eval_and_checkpoint(self) -> None:
        self._maybe_eval(self.progress)
        if not self.ctx.lead or self.ctx.local_rank != 0 or self.layout is not None:
            return
        # Periodic checkpoints are the shards' (sharded, DCP); the lead writes the final one.
        v = self.progress
        ck = self.exp.checkpoint_every if self.periodic_model_checkpoints else 0
        if ck and v // ck > self._last_ckpt and v < self.exp.total_steps:
            self._last_ckpt = v // ck
            if self._ckpt_thread is None or not self._ckpt_thread.is_alive():
                # Snapshot now, persist in the background: training does not wait for disk.
                snapshot = {k: t.detach().cpu().clone() for k, t in self.model.state_dict().items()}
                self._ckpt_thread = threading.Thread(
                    target=self._save, args=(snapshot, v, "periodic"), daemon=True
                )
                self._ckpt_thread.start()

    def finish(self) -> None:
        """Final eval and final checkpoint (lead, all local ranks hold the final parameters)."""
        self._finish_at(self.progress)
