"""One rank of bench/intranode.py: trains the MLP as one layout (single, ddp, fsdp, pipeline) on gloo.

Started by ``torch.multiprocessing.start_processes`` (spawn) as ``run(rank, world, port, spec, out)``;
writes ``<out>/rank<R>.json`` with the peak RSS growth, losses and timings of this rank.
"""

from __future__ import annotations

import ctypes
import datetime
import importlib
import json
import os
import pathlib
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _maxrss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the high-water mark of this process's resident set
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _linear(i: int, width: int, seed: int) -> nn.Linear:
    """Layer i of the MLP, initialised from its own seed so every layout trains the same weights."""
    torch.manual_seed(seed * 1000 + i)
    return nn.Linear(width, width)


def build_mlp(layers: int, width: int, seed: int, first: int = 0, last: int | None = None) -> nn.Sequential:
    """Linear layers [first, last) of the MLP, a ReLU after every Linear but the model's last."""
    last = layers if last is None else last
    mods: list[nn.Module] = []
    for i in range(first, last):
        mods.append(_linear(i, width, seed))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def batches(spec: dict[str, Any], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` global batches of a synthetic regression task: x ~ N(0, 1), y = sin of x rolled by one feature."""
    g = torch.Generator().manual_seed(spec["seed"])
    out = []
    for _ in range(n):
        x = torch.randn(spec["batch"], spec["width"], generator=g)
        out.append((x, torch.sin(x.roll(1, dims=1))))
    return out


def _timed(fn: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc.append(time.perf_counter() - t)

    return wrapper


def _train_loop(step: Callable[[int], float], spec: dict[str, Any], world: int) -> dict[str, Any]:
    """Warm-up steps, then timed steps between two barriers; losses, wall and CPU time, each step's time."""
    losses = [step(i) for i in range(spec["warmup"])]
    if world > 1:
        dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step_s = []
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        losses.append(step(i))
        step_s.append(time.perf_counter() - t)
    if world > 1:
        dist.barrier()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # every layout's step ends in a collective (loss all-reduce), so a rank's step time is the step's
    return {"losses": losses, "timed_s": wall, "cpu_s": cpu, "step_s": step_s,
            "samples_per_s": spec["batch"] * spec["steps"] / wall,
            "samples_per_s_median": spec["batch"] / statistics.median(step_s)}


def _mean_loss(loss: torch.Tensor, world: int) -> float:
    t = loss.detach().clone()
    if world > 1:
        dist.all_reduce(t)
    return float(t) / world


def _run_replicated(rank: int, world: int, spec: dict[str, Any], data: list[Any]) -> dict[str, Any]:
    """single (world 1) or ddp: every rank holds the whole model and its AdamW state."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model: nn.Module = build_mlp(spec["layers"], spec["width"], spec["seed"])
    if world > 1:
        # bucketed all-reduce overlapped with backward; grads are views into the buckets (no copy)
        model = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    share = spec["batch"] // world

    def step(i: int) -> float:
        x, y = data[i]
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return _mean_loss(loss, world)

    return _train_loop(step, spec, world)


def _run_fsdp(rank: int, world: int, spec: dict[str, Any], data: list[Any]) -> dict[str, Any]:
    """FSDP2: built on the meta device, each Linear sharded, then the root; the full model never exists."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = build_mlp(spec["layers"], spec["width"], spec["seed"])
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for m in linears:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, m in enumerate(linears):
            # one layer at a time materialised in full (16 MB at width 2048) so the shards hold the
            # same initial weights as the other layouts; this rank keeps its torch.chunk slice (dim 0)
            full = _linear(i, spec["width"], spec["seed"])
            for p, src in ((m.weight, full.weight), (m.bias, full.bias)):
                local = p.to_local()  # type: ignore[attr-defined]
                part = src.chunk(world, dim=0)[rank]
                local[: part.shape[0]].copy_(part)
            del full
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    share = spec["batch"] // world

    def step(i: int) -> float:
        x, y = data[i]
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return _mean_loss(loss, world)

    return _train_loop(step, spec, world)


def _pipeline_config(kind: str, m: int, submod: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int,
                     spec: dict[str, Any], data: list[Any]) -> dict[str, Any]:
    """Train `submod` as stage `rank` under one schedule with `m` micro-batches; per-step wall and busy times."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(submod, rank, world, torch.device("cpu"))
    busy: list[float] = []
    # compute only: the schedule posts and waits for its sends/recvs outside these two calls
    stage.forward_one_chunk = _timed(stage.forward_one_chunk, busy)  # type: ignore[method-assign]
    stage.backward_one_chunk = _timed(stage.backward_one_chunk, busy)  # type: ignore[method-assign]
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    sched = schedule_cls(stage, n_microbatches=m, loss_fn=F.mse_loss)
    walls: list[float] = []
    busies: list[float] = []

    def step(i: int) -> float:
        x, y = data[i]
        busy.clear()
        mb_losses: list[torch.Tensor] = []
        dist.barrier()  # both stages start the step together, so the makespan below is the pipeline's
        t = time.perf_counter()
        if stage.is_first:
            sched.step(x)
        else:
            sched.step(target=y, losses=mb_losses)
        # the last stage leaves step() while the first still runs its backward: the step lasts as long
        # as the slowest rank, and that is the wall each rank's busy time is measured against
        span = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        walls.append(float(span))
        busies.append(sum(busy))
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss = torch.stack(mb_losses).mean().detach() if mb_losses else torch.zeros(())
        dist.all_reduce(loss)  # the last stage's loss, so every rank reports it
        return float(loss)

    res = _train_loop(step, spec, world)
    w = spec["warmup"]
    return {"schedule": kind, "microbatches": m, **res, "step_wall_s": walls[w:], "step_busy_s": busies[w:]}


def _run_pipeline(rank: int, world: int, spec: dict[str, Any], data: list[Any]) -> dict[str, Any]:
    """One stage per rank (layers split evenly, built layer by layer); the whole (schedule, m) sweep on it."""
    per = spec["layers"] // world
    first, last = rank * per, (rank + 1) * per if rank < world - 1 else spec["layers"]
    submod = build_mlp(spec["layers"], spec["width"], spec["seed"], first, last)
    opt = torch.optim.AdamW(submod.parameters(), lr=spec["lr"])
    runs = [_pipeline_config(kind, m, submod, opt, rank, world, spec, data) for kind, m in spec["pipeline"]]
    return {"runs": runs, "losses": runs[0]["losses"]}


# modules each layout needs, imported before the memory baseline so imports are not counted as model memory
_IMPORTS = {"single": ["torch.nn.parallel"], "ddp": ["torch.nn.parallel"],
            "fsdp": ["torch.distributed.fsdp", "torch.distributed.device_mesh"],
            "pipeline": ["torch.distributed.pipelining"]}
_M_MMAP_THRESHOLD = -3  # mallopt parameter number, glibc malloc.h


def run(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    """Entry point of one rank; see the module docstring."""
    if spec.get("mmap_threshold"):
        # a fixed threshold turns off glibc's dynamic one: every tensor above it is its own mmap,
        # unmapped on free, so RSS follows live tensor bytes instead of heap fragmentation
        if ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, int(spec["mmap_threshold"])) != 1:
            raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    layout = spec["layout"]
    if layout not in _IMPORTS:
        raise ValueError(f"unknown layout {layout!r}")
    for mod in _IMPORTS[layout]:
        importlib.import_module(mod)
    data = batches(spec, spec["warmup"] + spec["steps"])
    dist.barrier()
    base_max, base_rss = _maxrss_mb(), _rss_mb()
    if layout in ("single", "ddp"):
        res = _run_replicated(rank, world, spec, data)
    elif layout == "fsdp":
        res = _run_fsdp(rank, world, spec, data)
    else:
        res = _run_pipeline(rank, world, spec, data)
    peak = _maxrss_mb()
    res.update(rank=rank, world=world, layout=layout, baseline_maxrss_mb=base_max, baseline_rss_mb=base_rss,
               peak_maxrss_mb=peak, peak_growth_mb=peak - base_rss, peak_set_after_baseline=peak > base_max)
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
