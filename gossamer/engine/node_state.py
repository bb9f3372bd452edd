"""Sharded checkpoints of one node's training state (parameters, optimizer, data position, RNG) that reshard.

Each local rank writes the pieces of the flat parameter vector it holds (FSDP: its rows of
every parameter; pipeline: its stage's layers; ddp: an even slice of the replica) with
their elementwise optimizer state, as one shard of a `gossamer.checkpoint.sharded` step
directory (DCP files, sha256 manifest, atomic rename). Loading reads any flat range back
from whichever shards saved it, so a state saved by 2 FSDP ranks loads onto 1 or 3, or onto
a different number of pipeline stages.
"""

from __future__ import annotations

import base64
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gossamer.checkpoint.sharded import (
    ShardSnapshot,
    restore_range,
    save_shard,
    step_dir,
    verify_step,
)
from gossamer.core.errors import CheckpointError

if TYPE_CHECKING:
    from gossamer.engine.layout import NodeLayout

__all__ = ["NodeResume", "load_node_state", "save_node_state"]

log = logging.getLogger(__name__)


@dataclass
class NodeResume:
    """What `load_node_state` restored."""

    step: int
    data: dict[str, Any]
    rng_restored: bool  # False: saved with another layout; the RNG was re-seeded from (seed, step, rank)
    saved_layout: str
    saved_world: int
    env: dict[str, Any]


def _rng_state() -> dict[str, str]:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict[str, str]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_node_state(root: str | os.PathLike[str], step: int, layout: NodeLayout,
                    optimizer: torch.optim.Optimizer | None = None, *, experiment: str = "",
                    data: dict[str, Any] | None = None) -> Path:
    """Every local rank calls this; returns the step directory once every rank's shard is on disk.

    `data` is the data position (e.g. {"step": s, "epoch": e}); the RNG state and the
    environment fingerprint are added.
    """
    from gossamer.core.envinfo import fingerprint

    rank, world = _rank_world()
    pieces: dict[int, dict[str, torch.Tensor]] = {}
    scalars: dict[int, dict[str, float]] = {}
    for r in layout.owned_regions():
        entry = {"param": r.local().detach().float().cpu().clone()}
        state = optimizer.state.get(r.param, {}) if optimizer is not None else {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() == r.param.numel() and value.dim():
                entry[name] = r.piece(value).float().cpu().clone()
            elif isinstance(value, torch.Tensor | int | float):
                scalars.setdefault(r.flat_offset, {})[name] = float(value)
        pieces[r.flat_offset] = entry
    snap = ShardSnapshot(
        experiment=experiment or "node", step=step, shard=rank, num_shards=world, total_numel=layout.total_numel,
        version=step, pieces=pieces, scalars=scalars,
        layout=[(n, list(s)) for n, s in layout.shapes.items()],
        extra={"kind": "node", "parallelism": layout.kind, "world": world, "data": data or {"step": step},
               "rng": _rng_state(), "env": fingerprint(layout.device)},
    )
    save_shard(root, snap)
    if world > 1:
        dist.barrier()  # the step is complete only when every rank's shard is in place
    return step_dir(root, step)


def load_node_state(step: str | os.PathLike[str], layout: NodeLayout,
                    optimizer: torch.optim.Optimizer | None = None, *, seed: int = 0) -> NodeResume:
    """Restore this rank's pieces (and optimizer state) from a node checkpoint saved with any layout.

    The RNG state comes back exactly when the checkpoint was saved with the same layout and
    number of ranks; otherwise each rank is re-seeded from (seed, step, rank).

    Raises:
        CheckpointError: missing, incomplete or corrupt checkpoint, or one of another model.
    """
    ms = verify_step(step)
    first = ms[0]
    if first["total_numel"] != layout.total_numel:
        raise CheckpointError(f"{step}: saved {first['total_numel']} parameters, this model has "
                              f"{layout.total_numel}")
    rank, world = _rank_world()
    with torch.no_grad():
        for r in layout.regions:
            vecs, scal, _ = restore_range(step, r.flat_offset, r.numel, ms)
            r.local().copy_(vecs.pop("param").to(r.local().device))
            if optimizer is None:
                continue
            state = optimizer.state[r.param]
            for name, v in vecs.items():
                if name not in state:
                    state[name] = torch.zeros_like(r.param)
                r.piece(state[name]).copy_(v.to(r.local().device))
            for name, value in scal.items():
                state[name] = torch.tensor(value)
    mine = next((m for m in ms if m["shard"] == rank), first)
    extra = mine.get("extra", {})
    same = extra.get("parallelism") == layout.kind and int(extra.get("world", -1)) == world
    if same and "rng" in extra:
        _set_rng_state(extra["rng"])
    else:
        torch.manual_seed((seed * 1_000_003 + int(first["step"]) * 101 + rank) % (2**63))
    if not same:
        log.info("node state %s was saved by %s over %s ranks; loaded onto %s over %d", step,
                 extra.get("parallelism"), extra.get("world"), layout.kind, world)
    return NodeResume(step=int(first["step"]), data=dict(extra.get("data", {})), rng_restored=same,
                      saved_layout=str(extra.get("parallelism", "")), saved_world=int(extra.get("world", 0)),
                      env=dict(extra.get("env", {})))
