"""A node training on its own with a local optimizer, for node-checkpoint tests (spawned per local rank)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gossamer.core.experiment import Experiment
from gossamer.engine import sampler
from gossamer.engine.layout import make_layout, stack_batch
from gossamer.engine.node_state import load_node_state, save_node_state
from gossamer.engine.precision import LossScaler, check_precision
from gossamer.engine.process_group import backend_of, end_process_group, exit_process
from gossamer.examples.digits import data, mlp
from gossamer.node.ports import reserve_port
from gossamer.paramserver.optimizer import OptimizerConfig, build_optimizer


def run_rank(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    backend = cfg.get("backend", "gloo")
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_of(backend == "nccl"), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    finished = False
    try:
        exp = Experiment(name="node", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                         parallelism=cfg["parallelism"], pipeline_schedule=cfg.get("schedule", "1f1b"),
                         pipeline_microbatches=4, batch_size=32, optimizer="sgd", lr=0.05, momentum=0.9,
                         max_grad_norm=cfg.get("max_grad_norm", 0.0), precision=cfg.get("precision", "fp32"), seed=3)
        check_precision(exp, device)
        torch.manual_seed(exp.seed)
        model = mlp().to(device)
        train, _ = data()
        layout = make_layout(model, exp, rank, world, device)
        scaler = LossScaler() if exp.precision == "fp16" else None
        skipped = 0
        opt = build_optimizer(OptimizerConfig(name="sgd", lr=exp.lr, momentum=exp.momentum), list(layout.module.parameters()))
        start = 0
        if cfg.get("load"):
            start = int(load_node_state(cfg["load"], layout, opt, seed=exp.seed).data["step"])
        losses: list[float] = []
        for step in range(start, start + cfg["steps"]):
            idx = sampler.async_batch(len(train), exp.batch_size, step, exp.seed, 0)
            share = idx if layout.kind == "pipeline" else sampler.even_split(idx, world, rank)
            x, y = stack_batch(train, share)
            layout.zero_grad()
            total, _ = layout.forward_backward((x.to(device), y.to(device)), float(idx.numel()),
                                               scaler.scale if scaler else 1.0)
            layout.reduce_gradients()
            if scaler is not None:
                for r in layout.regions:
                    g = r.grad()
                    if g is not None:
                        g.div_(scaler.scale)
                if not scaler.update(layout.all_finite()):
                    skipped += 1
                    continue
            if exp.max_grad_norm:
                layout.clip_gradients(exp.max_grad_norm)
            opt.step()
            node = torch.tensor([total], dtype=torch.float64)  # a CPU tensor, as the loop's counters are
            if layout.kind != "pipeline":
                dist.all_reduce(node)
            losses.append(float(node[0]) / idx.numel())
            if cfg.get("save") and step + 1 == cfg["save_at"]:
                save_node_state(cfg["save"], step + 1, layout, opt, data={"step": step + 1})
        out = Path(cfg["out"])
        torch.save(layout.read_flat(), out / f"params-{rank}.pt")
        if rank == 0:
            (out / "losses.json").write_text(json.dumps({"start": start, "losses": losses, "skipped": skipped,
                                                         "device": str(device)}))
        finished = True
    finally:
        end_process_group(finished_together=finished)
    exit_process(0)  # as a worker rank does: torch may still hold the destroyed group's threads


def run_node(world: int, out: Path, **cfg: Any) -> dict[str, Any]:
    """Start `world` local ranks of `run_rank`; the trained flat parameters and the losses."""
    # Imported here: each rank imports this module, and needs none of the fixtures' imports
    from tests._fixtures import warm_context

    out.mkdir(parents=True, exist_ok=True)
    warm_context()  # the ranks fork from the warm fork server, not a fresh interpreter each
    with reserve_port() as hold:  # bound until the ranks are done: nobody else may take the port meanwhile
        mp.start_processes(run_rank, args=(world, hold.getsockname()[1], {**cfg, "out": str(out)}), nprocs=world,
                           start_method="forkserver", join=True)
    flat = torch.empty(sum(p.numel() for p in mlp().parameters()))
    filled = torch.zeros(flat.numel(), dtype=torch.bool)
    for rank in range(world):
        for off, t in torch.load(out / f"params-{rank}.pt").items():
            flat[off : off + t.numel()] = t
            filled[off : off + t.numel()] = True
    assert bool(filled.all())
    return {"flat": flat, **json.loads((out / "losses.json").read_text())}
