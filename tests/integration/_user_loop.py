"""A user's own training loop, as a researcher writes it: AdamW (0.9, 0.95), a warm-up, accumulation 2, clipping."""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from gossamer.examples.digits import data, mlp

ACCUMULATE = 2


def train(ctx) -> None:  # type: ignore[no-untyped-def]
    _loop(ctx, no_sync=False)


def train_no_sync(ctx) -> None:  # type: ignore[no-untyped-def]
    """`train`, with the backward passes before the last of each step inside `ctx.no_sync()` (as with torch DDP)."""
    _loop(ctx, no_sync=True)


def train_reporting_ranks(ctx) -> None:  # type: ignore[no-untyped-def]
    """`train` (`no_sync` from the environment), then every process reports where it is and a checksum of its model."""
    model = _loop(ctx, no_sync=os.environ.get("USER_LOOP_NO_SYNC") == "1")
    checksum = _checksum(model)
    ctx.report(checksum=checksum, local_rank=ctx.local_rank, local_world_size=ctx.local_world_size, rank=ctx.rank,
               world_size=ctx.world_size)


def _loop(ctx, *, no_sync: bool) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    model = mlp(hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    warmup = LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    model, optimizer = ctx.prepare(model, optimizer)
    train_set, eval_set = data()
    hold = int(os.environ.get("USER_LOOP_HOLD_FROM", "0"))
    release = os.environ.get("USER_LOOP_RELEASE_FILE", "")
    started_at = ctx.step
    mode = ctx.experiment.mode
    held_since = 0.0
    for i, (x, y) in enumerate(ctx.data(train_set, batch_size=16)):
        # A test's worker that started before `hold` is held there until the test releases it (120 s at most), so a
        # worker joining mid-run trains before the run ends however fast the run is; one that joins past `hold` is
        # never held. In sync a joiner steps with the others: they wait only for it to come. In diloco a joiner is
        # let into the round only when a round ends: held workers go on stepping, slowly.
        waiting = ctx.world_size < 2 if mode == "sync" else not os.path.exists(release)
        if hold and started_at < hold <= ctx.step and waiting and held_since < 120:
            pause = 0.2 if mode == "diloco" else 0.05
            time.sleep(pause)
            held_since += pause
            if mode != "diloco":
                continue
        loss = F.cross_entropy(model(x), y) / ACCUMULATE
        last = i % ACCUMULATE == ACCUMULATE - 1
        with contextlib.nullcontext() if last or not no_sync else ctx.no_sync():
            loss.backward()
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            warmup.step()
            optimizer.zero_grad()
            ctx.report(loss=loss.item() * ACCUMULATE, lr=warmup.get_last_lr()[0])
    if ctx.is_lead:
        ctx.report(eval_accuracy=accuracy(model, eval_set))
    return model


def _checksum(model: torch.nn.Module) -> float:
    """Each parameter's values weighted by their positions, summed: equal only for (bit-)equal models."""
    return sum(float(p.detach().double().mul(torch.arange(1, p.numel() + 1, dtype=torch.float64).view_as(p)).sum())
               for p in model.parameters())


def accuracy(model: torch.nn.Module, eval_set: torch.utils.data.Dataset) -> float:  # type: ignore[type-arg]
    x, y = torch.utils.data.default_collate([eval_set[i] for i in range(len(eval_set))])  # type: ignore[arg-type]
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def raises(ctx) -> None:  # type: ignore[no-untyped-def]
    model = mlp(hidden=8)
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, _ in enumerate(ctx.data(data()[0], batch_size=8)):
        if step == 3:
            raise ValueError("the user's loop broke at step 3")
        optimizer.step()


def steps_inside_no_sync(ctx) -> None:  # type: ignore[no-untyped-def]
    model = mlp(hidden=8)
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in ctx.data(data()[0], batch_size=8):
        with ctx.no_sync():
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def steps_its_own_optimizer(ctx) -> None:  # type: ignore[no-untyped-def]
    model = mlp(hidden=8)
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = ctx.prepare(model, mine)
    for x, y in ctx.data(data()[0], batch_size=8):
        F.cross_entropy(model(x), y).backward()
        mine.step()  # the optimizer it built, not the one ctx.prepare returned


def reshapes(ctx) -> None:  # type: ignore[no-untyped-def]
    model = mlp(hidden=8)
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    first = next(model.parameters())
    first.data = torch.zeros(3, 3)
    for _ in ctx.data(data()[0], batch_size=8):
        optimizer.step()


def builtin_equivalent(ctx) -> None:  # type: ignore[no-untyped-def]
    """What the built-in loop does for `model=digits:mlp`, `dataset=digits:data`, SGD with momentum 0.9, lr 0.05."""
    model = mlp()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for x, y in ctx.data(data()[0]):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


class Drift(torch.optim.Optimizer):
    """An optimizer a user wrote: every step moves every parameter by -`by`, whatever its gradient."""

    def __init__(self, params, by: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"by": by})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(group["by"])


def drift(ctx) -> None:  # type: ignore[no-untyped-def]
    """Each worker's change over a DiLoCo round is known exactly: `inner_steps` x 0.01 on every value."""
    model = mlp(hidden=64)
    model, optimizer = ctx.prepare(model, Drift(model.parameters(), by=0.01))
    train_set, _ = data()
    for x, y in ctx.data(train_set, batch_size=16):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def train_fp16(ctx) -> None:  # type: ignore[no-untyped-def]
    """fp16 autocast with torch's own GradScaler around the prepared optimizer; the last rank's step 5 overflows.

    `scaler.step(optimizer)` skips the step of a non-finite gradient (the scale halves): in sync every worker
    sees the workers' mean, inf for all of them, and all skip it together.
    """
    model = mlp(hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    model, optimizer = ctx.prepare(model, optimizer)
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=2.0**10)
    train_set, _ = data()
    for step, (x, y) in enumerate(ctx.data(train_set, batch_size=16)):
        with torch.autocast(ctx.device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        if step == 5 and ctx.rank == ctx.world_size - 1:
            loss = loss * float("inf")  # an overflow on this worker alone
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    checksum = _checksum(model)
    ctx.report(scale=scaler.get_scale(), checksum=checksum, rank=ctx.rank)


def train_one_rank_touches_a_parameter(ctx) -> None:  # type: ignore[no-untyped-def]
    """Local rank 0 gives `extra` a zero gradient, the other ranks none; AdamW's weight decay then steps it only
    where it has one, so the node's ranks stay alike only if every rank gets a gradient wherever one did."""
    model = mlp(hidden=8)
    model.extra = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    model, optimizer = ctx.prepare(model, optimizer)
    for x, y in ctx.data(data()[0], batch_size=8):
        loss = F.cross_entropy(model(x), y)
        if ctx.local_rank == 0:
            loss = loss + 0.0 * model.extra.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ctx.report(extra=float(model.extra.sum()), local_rank=ctx.local_rank)
