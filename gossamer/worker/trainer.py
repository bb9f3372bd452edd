"""The training loop of one local rank: compute, all-reduce inside the node, exchange its slice with the shards."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gossamer._import_check import resolve
from gossamer.checkpoint.manifest import save_model_checkpoint
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.errors import ShardError
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


def build(exp: Experiment, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """Model (seeded, so every process builds identical initial parameters) and (train, eval) data."""
    torch.manual_seed(exp.seed)
    model = resolve(exp.model)(**exp.model_args).to(device)  # type: ignore[operator]
    train, evalset = resolve(exp.dataset)(**exp.dataset_args)  # type: ignore[operator]
    return model, train, evalset


def _stack(ds: Any, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = getattr(ds, "tensors", None)
    if tensors is not None:  # TensorDataset: index all at once
        return tensors[0][idx], tensors[1][idx]
    items = [ds[int(i)] for i in idx]
    return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items])


def _unflatten_grads(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        n = p.numel()
        if p.grad is not None:
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def loss_sum(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy and the number of predictions it covers.

    Classifiers give (B, C) logits for (B,) labels; sequence models (B, T, V) for (B, T)
    targets, and every position counts as one prediction.
    """
    if out.dim() > 2:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return F.cross_entropy(out, y, reduction="sum"), y.numel()


@torch.no_grad()
def evaluate(model: nn.Module, ds: Any, device: torch.device, batch: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over a whole dataset, per prediction (per token for sequences)."""
    model.eval()
    correct, loss, count, n = 0, 0.0, 0, len(ds)
    for start in range(0, n, batch):
        x, y = _stack(ds, torch.arange(start, min(n, start + batch)))
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
        self.model, self.train_set, self.eval_set = build(self.exp, ctx.device)
        self.on_metrics = on_metrics or (lambda step, values: None)
        self.flush_metrics: Callable[[], None] = lambda: None  # the role process sets the reporter's flush
        self.updates = updates or (lambda: None)
        self.should_stop = should_stop or (lambda: False)
        self.flat = flatten_params(self.model).to(ctx.device)
        self.flat_grad: torch.Tensor | None = None
        self._bind_flat()
        self.clock = 0
        self.stats = StepStats()
        self._last_eval = 0
        self.final_path = ""
        self.final_metrics: dict[str, float] = {}
        self.profiler = StepProfiler(self.exp, experiment_id=ctx.experiment_id, node_id=ctx.node_id,
                                     node_name=ctx.node_name, local_rank=ctx.local_rank, device=ctx.device,
                                     checkpoint_dir=ctx.checkpoint_dir, on_metrics=lambda s, v: self.on_metrics(s, v))

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
        return sampler.even_split(idx, self.ctx.local_world, self.ctx.local_rank), idx.numel()

    def _local_grad(self, fault_ctx: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Backprop this rank's samples and all-reduce inside the node.

        Returns the node's flat gradient (the mean over the node's samples; `p.grad` holds
        it too), [samples, summed loss per sample] of the node, and the compute seconds.
        """
        t_compute = time.perf_counter()
        idx, denom = self._batch()
        x, y = _stack(self.train_set, idx)
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        self.model.zero_grad(set_to_none=False)
        total, predictions = loss_sum(self.model(x), y)
        per_sample = max(1, predictions // max(1, y.shape[0]))  # 1 for classifiers, T for sequences
        (total / (denom * per_sample)).backward()
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
            if self.flat_grad is None:
                _unflatten_grads(self.model, grad)
        if self.ctx.step_delay_s:
            time.sleep(self.ctx.step_delay_s)
        return grad, node_samples, time.perf_counter() - t_compute

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
        acc, loss = evaluate(self.model, self.eval_set, self.ctx.device)
        self.on_metrics(step, {"eval_accuracy": acc, "eval_loss": loss, "eval_step": float(step)})
        return acc, loss

    def _maybe_eval(self, step: int) -> None:
        """Lead, local rank 0: evaluate every `eval_every` steps of progress."""
        every = self.exp.eval_every
        if self.ctx.lead and self.ctx.local_rank == 0 and every and step // every > self._last_eval \
                and step < self.exp.total_steps:
            self._last_eval = step // every
            self._evaluate(step)

    def checkpoint_path(self, label: str) -> Path:
        return Path(self.ctx.checkpoint_dir) / self.ctx.experiment_id / label

    def _save(self, state: dict[str, torch.Tensor], step: int, kind: str) -> str:
        label = "final" if kind == "final" else f"step-{step:08d}"
        path = save_model_checkpoint(
            self.checkpoint_path(label), state,
            {"experiment_id": self.ctx.experiment_id, "step": step, "kind": kind,
             "experiment": self.exp.to_dict(), "torch": torch.__version__},
        )
        self.on_metrics(step, {"checkpoint_step": float(step)})
        self.saved(step, str(path), kind)
        return str(path)

    def saved(self, step: int, path: str, kind: str) -> None:
        """Hook: a checkpoint was written (the role process registers it with the coordinator)."""

    def _finish_at(self, step: int, extra: dict[str, float] | None = None) -> None:
        """Final eval and final checkpoint of the parameters this rank holds (local rank 0)."""
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

    def __init__(self, ctx: RankContext, *, on_metrics: Hook | None = None,
                 updates: Callable[[], dict[str, Any] | None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop)
        self.plan = ShardPlan.for_module(self.model, self.exp.num_ps_shards, self.exp.chunk_numel)
        self.mine = self.plan.chunks_of_rank(ctx.local_rank, ctx.local_world)
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
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

    # --- parameter exchange ------------------------------------------------------------
    def _assemble(self, values: dict[int, torch.Tensor], done: bool) -> bool:
        """Make every local rank hold the full parameters, given this rank's fresh chunks.

        Returns `done` agreed by all local ranks: one rank's shards may report the end a
        step before another's, and a rank that stopped alone would leave the others in
        their next collective. The flag rides in the same all-reduce as the parameters.
        """
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
        return self.version

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
        return sampler.even_split(idx, self.ctx.local_world, self.ctx.local_rank), g

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
        while not done and not self.should_stop():
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
            if self.ctx.lead:
                self.pull()  # the final parameters, whoever pushed last
                self.finish()
        self.client.leave()
        self.client.close()
        log.info("worker %d rank %d finished after %d steps (%.1f s)", self.ctx.worker_index,
                 self.ctx.local_rank, self.stats.steps, time.monotonic() - t0)

    def _on_wait(self) -> None:
        self._apply_updates()
        if self._exchanging and self.should_stop():
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
        if not self.ctx.lead or self.ctx.local_rank != 0:
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
