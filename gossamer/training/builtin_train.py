"""gossamer's own loop over the experiment's `model`, `dataset`, `loss`, optimizer and lr schedule, as a train function."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from gossamer.core.experiment import Experiment
from gossamer.core.lr_schedule import lr_multiplier
from gossamer.core.modes import mode_of
from gossamer.core.train_path import shards_step_optimizer
from gossamer.engine import sampler
from gossamer.engine.batches import Data, to_device
from gossamer.engine.loader import StepLoader, Want, index_tuple, want_len
from gossamer.engine.loss import Objective
from gossamer.engine.model import build, evaluate_metrics, experiment_data, user_metrics
from gossamer.paramserver.optimizer import set_lr_factor
from gossamer.training.local_optimizer import inner_optimizer
from gossamer.training.shards.gradient_push import StepRedo
from gossamer.training.train_function import ShardStepped, TrainContext

__all__ = ["train"]


def train(ctx: TrainContext) -> None:
    """gossamer's loop: each step this worker's samples (`_want`), the experiment's loss, clipping, optimizer and
    lr schedule; the mode's exchange is in the optimizer's step, and the lead evaluates the run's model every
    `eval_every` steps and at the end (`TrainContext.evaluate_with`). In async and sync the shards step the
    experiment's optimizer on the gradient the step pushes (`ShardStepped`), as with the older trainers."""
    exp = ctx.experiment
    model, train_set, eval_set = build(exp, ctx.device)
    on_shards = shards_step_optimizer(exp)
    local = ShardStepped(model.parameters()) if on_shards else inner_optimizer(exp, model.parameters())
    model, optimizer = ctx.prepare(model, local)
    train_data, eval_data = experiment_data(exp, train_set, eval_set)
    objective = Objective(exp.loss)

    def figures() -> dict[str, float]:
        values = evaluate_metrics(model, eval_data, ctx.device, objective, limit=exp.eval_samples)
        return {**values, **user_metrics(exp, model, eval_set)}

    ctx.evaluate_with(figures)
    loader = StepLoader(train_data, num_workers=exp.num_workers, prefetch=exp.prefetch)
    try:
        _loop(ctx, model, optimizer, loader, objective)
    finally:
        loader.close()  # read-ahead threads and DataLoader worker processes


def _loop(ctx: TrainContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: StepLoader,
          objective: Objective) -> None:
    exp = ctx.experiment
    t_report, samples, loss_sum, grad_norm = time.monotonic(), 0, 0.0, float("nan")
    # async: a worker's samples follow its own steps, as the older trainer's (the run's steps are shard versions)
    own_steps = shards_step_optimizer(exp) and not mode_of(exp).allows_global_batch
    mine = 0
    # Several local ranks: each backward ends with the node's mean of the ranks' gradients, so each rank's loss
    # is over its share of the node's batch times the ranks (the mean is then the node batch's gradient).
    ranks = ctx.local_world_size
    while not ctx.should_stop():
        step, workers = mine if own_steps else ctx.step, ctx.world_size // ranks
        want, share = _want(ctx, loader.data, step)
        batch = to_device(loader.get(step, _wants(ctx, loader.data, step, want)), ctx.device)
        model.zero_grad(set_to_none=True)
        with _autocast(exp, ctx.device):
            out = objective.forward(model, batch)
        total, _ = objective.loss_sum(out, batch)
        per_sample = objective.per_sample(batch)
        (total * (ranks / (share * per_sample))).backward()  # the older trainers' arithmetic: the same bits
        if exp.max_grad_norm:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), exp.max_grad_norm))
        n = want_len(want)
        ctx.count(n)
        set_lr_factor(optimizer, exp.lr, exp.linear_lr_factor(workers)
                      * lr_multiplier(step, exp.total_steps, exp.lr_schedule, exp.warmup_steps))
        try:
            optimizer.step()
        except StepRedo:
            ctx.count(-n)  # counted once the step goes through
            continue  # sync: the barrier re-formed or the shards moved on; the step's samples are the workers' now
        mine += 1
        samples, loss_sum = samples + n, loss_sum + float(total.detach()) / per_sample
        now = time.monotonic()
        if now - t_report >= 1.0 or ctx.should_stop():
            ctx.report(loss=loss_sum / max(1, samples), **({"grad_norm": grad_norm} if exp.max_grad_norm else {}))
            t_report, samples, loss_sum = now, 0, 0.0


def _want(ctx: TrainContext, data: Data, step: int) -> tuple[Want, float]:
    """This rank's samples of `step`, and what the node's summed loss is divided by.

    sync: its worker's share of the step's global batch (the same samples whatever the workers), over the global
    batch, so the sum of the workers' gradients the shards step on is one process's over the global batch.
    Otherwise its worker's own batch of `batch_size` (a stream: its piece of the step's span), over its size.
    `batch_size` is a node's: several local ranks each take their share of the node's samples.
    """
    exp = ctx.experiment
    ranks = ctx.local_world_size
    workers, me = ctx.world_size // ranks, ctx.rank // ranks
    if not mode_of(exp).allows_global_batch:
        if data.stream:
            start, stop = sampler.stream_span(step, exp.batch_size * workers, workers, me)
            return _rank_span(ctx, start, stop), float(stop - start)
        idx = sampler.async_batch(len(data), exp.batch_size, step, exp.seed, ctx.worker_index)
        return ("idx", index_tuple(sampler.even_split(idx, ranks, ctx.local_rank))), float(idx.numel())
    g = exp.effective_global_batch(workers)
    if data.stream:  # the step's span of the stream, this worker's piece of it
        start, stop = sampler.stream_span(step, g, workers, me)
        return _rank_span(ctx, start, stop), float(g)
    idx = sampler.even_split(sampler.sync_global_batch(len(data), g, step, exp.seed), workers, me)
    return ("idx", index_tuple(sampler.even_split(idx, ranks, ctx.local_rank))), float(g)


def _rank_span(ctx: TrainContext, start: int, stop: int) -> Want:
    """This rank's run of the node's stream positions [start, stop) (the whole run on a node of one rank)."""
    mine = sampler.even_split(range(start, stop), ctx.local_world_size, ctx.local_rank)
    return ("span", mine.start, mine.stop)


def _wants(ctx: TrainContext, data: Data, step: int, want: Want) -> Callable[[int], Want]:
    """The samples of any step, for the loader's read-ahead (`step`'s are known already)."""
    return lambda s: want if s == step else _want(ctx, data, s)[0]


def _autocast(exp: Experiment, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if exp.precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
