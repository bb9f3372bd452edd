"""How a node lays its model over its local ranks: replicated (ddp), sharded (FSDP2) or staged (pipeline)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer.core.errors import ConfigError, GossamerError
from gossamer.core.experiment import Experiment
from gossamer.engine.allocator import mmap_large_allocations
from gossamer.engine.batches import Data, Selection, batch_samples, stack_batch, to_device
from gossamer.engine.loss import EvalTotals, Objective, loss_sum
from gossamer.engine.sampler import even_split
from gossamer.engine.shard_plan import (
    FSDP_MAX_LOCAL_RANKS,
    Chunk,
    ShardPlan,
    flatten_grads,
    flatten_params,
    fsdp_row_cuts,
    unflatten_into,
)

log = logging.getLogger(__name__)

__all__ = [
    "FSDP_MAX_LOCAL_RANKS",
    "NodeLayout",
    "Region",
    "ReplicatedLayout",
    "fsdp_row_cuts",
    "loss_sum",
    "make_layout",
    "pipeline_split",
    "rank_layout",
    "shards_model",
    "stack_batch",
]


@dataclass(frozen=True)
class Region:
    """A contiguous piece of the full model's flat parameter vector that this rank holds."""

    name: str
    flat_offset: int
    numel: int
    param: nn.Parameter

    def piece(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `t`, a tensor shaped (and, under FSDP, sharded) like the parameter."""
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.detach().view(-1)

    def local(self) -> torch.Tensor:
        """This rank's values of the piece, as a writable 1-D view of the module's storage."""
        return self.piece(self.param.data if not hasattr(self.param, "to_local") else self.param)

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return None if g is None else self.piece(g)


def _param_offsets(model: nn.Module) -> dict[str, int]:
    offsets, total = {}, 0
    for name, p in model.named_parameters():
        offsets[name] = total
        total += p.numel()
    return offsets


def pipeline_split(model: nn.Module, stages: int) -> list[list[int]]:
    """Contiguous groups of `model`'s children, one per stage, balanced by parameter count.

    Raises:
        ConfigError: the model is not an nn.Sequential with at least `stages` children
            that hold parameters.
    """
    if not isinstance(model, nn.Sequential):
        raise ConfigError("parallelism", f"pipeline needs an nn.Sequential model, got {type(model).__name__}")
    sizes = [sum(p.numel() for p in child.parameters()) for child in model]
    if sum(1 for s in sizes if s) < stages:
        raise ConfigError("parallelism", f"pipeline over {stages} local ranks needs at least {stages} layers "
                                         f"with parameters; the model has {sum(1 for s in sizes if s)}")
    with_params = [i for i, s in enumerate(sizes) if s]
    total, before, stage_of, prev = sum(sizes), 0, {}, 0
    for j, i in enumerate(with_params):
        want = min(stages - 1, int((before + sizes[i] / 2) * stages / total))  # by the layer's middle
        # Monotone, at most one stage further per layer, and a layer left for every later stage.
        prev = stage_of[i] = max(min(want, prev + 1 if j else 0), stages - (len(with_params) - j))
        before += sizes[i]
    groups: list[list[int]] = [[] for _ in range(stages)]
    stage = 0
    for i in range(len(sizes)):
        stage = stage_of.get(i, stage)  # a layer without parameters rides with the one before
        groups[stage].append(i)
    return groups


class NodeLayout:
    """How the model lies over a node's local ranks; the base holds what sharded layouts share.

    Every layout exposes the same things: which pieces of the full flat parameter vector this
    rank holds (`regions`, what it checkpoints), one forward/backward over a node batch, the
    node-wide gradient (unscale, finite check, clipping by its global norm), evaluation, and
    for a training rank the plan chunks it exchanges with other nodes (`chunks`,
    `chunk_grads`, `write_chunks`). All methods that communicate must be called by every
    local rank, in the same order.
    """

    kind = "ddp"

    def __init__(self, model: nn.Module, exp: Experiment, rank: int, world: int, device: torch.device) -> None:
        self.exp, self.rank, self.world, self.device = exp, rank, world, device
        self.objective = Objective(exp.loss)
        self.full_offsets = _param_offsets(model)
        self.total_numel = sum(p.numel() for p in model.parameters())
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.module = self._wrap(model)
        self.regions = self._regions()
        #: The whole model as one flat fp32 vector where a rank holds it all (else empty).
        self.flat = torch.zeros(0)
        self._plan: ShardPlan | None = None
        self._slots: dict[int, tuple[Region, int]] | None = None

    # --- construction ------------------------------------------------------------------
    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def _regions(self) -> list[Region]:
        return [Region(n, self.full_offsets[n], p.numel(), p) for n, p in self.module.named_parameters()]

    def owned_regions(self) -> list[Region]:
        """The pieces this rank writes to a node checkpoint (disjoint across the node's ranks)."""
        return self.regions

    @property
    def holds_full_model(self) -> bool:
        """Every local rank holds the whole model: it evaluates, checkpoints and gives a step up on
        its own. Otherwise the node's ranks decide those together (collectively)."""
        return True

    # --- one step ----------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.exp.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def forward_backward(self, batch: Any, denom: float, loss_scale: float = 1.0) -> tuple[float, int]:
        """Backprop sum(loss) * loss_scale / denom over this rank's part of the node batch (on the device).

        Returns the rank's summed loss and its number of predictions (each the node's total
        for pipeline, which only the last stage knows: it is shared with the other stages).
        """
        with self.autocast():
            out = self.objective.forward(self.module, batch)
        total, k = self.objective.loss_sum(out, batch)
        (total * (loss_scale / denom)).backward()
        return float(total.item()), k

    def reduce_gradients(self) -> None:
        """Make every rank's local gradient the node's (ddp all-reduces; sharded layouts already are)."""
        if self.world > 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def release_gradients(self) -> None:
        """Free the gradient until the next backward makes it again (DiLoCo's outer exchange needs none)."""
        self.zero_grad()

    def grad_sq_norm(self) -> float:
        """The squared L2 norm of the node's whole gradient (collective for sharded layouts)."""
        local = torch.zeros((), dtype=torch.float64)
        for r in self.regions:
            g = r.grad()
            if g is not None:
                local += g.double().pow(2).sum().cpu()
        if not self.holds_full_model and self.world > 1:
            dist.all_reduce(local)
        return float(local)

    def clip_gradients(self, max_norm: float) -> float:
        """Scale the node's gradient so its global L2 norm is at most `max_norm`; returns the norm before."""
        norm = math.sqrt(self.grad_sq_norm())
        if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for r in self.regions:
                g = r.grad()
                if g is not None:
                    g.mul_(scale)
        return norm

    def all_finite(self) -> bool:
        """Whether the node's gradient is finite everywhere (agreed by every rank)."""
        ok = torch.tensor([1.0])
        for r in self.regions:
            g = r.grad()
            if g is not None and not bool(torch.isfinite(g).all()):
                ok[0] = 0.0
                break
        if self.world > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok[0] > 0)

    # --- a training rank's node gradient ---------------------------------------------------
    #: Each rank computes its own samples, so the node's sample count and loss are summed.
    splits_batch = True

    def rank_share(self, sel: Selection) -> Selection:
        """This rank's samples of the node batch `sel` (indices, or items read from a stream)."""
        return even_split(sel, self.world, self.rank)

    def node_gradient(self, batch: Any, denom: int, samples: int, loss_scale: float,
                      before_reduce: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Backprop this rank's samples; each rank ends with the node gradient of its own regions.

        Returns the node's flat gradient where a rank holds it whole (empty here), and the
        node's [samples, summed loss per sample]. `before_reduce` runs before the first collective.
        """
        self.zero_grad()
        per_sample = self.objective.per_sample(batch)
        before_reduce()
        total, _ = self.forward_backward(batch, denom * per_sample, loss_scale)
        node_samples = torch.tensor([float(samples), total / per_sample])
        if self.splits_batch:  # each rank had its own samples; a pipeline stage saw them all
            dist.all_reduce(node_samples)
        return torch.zeros(0), node_samples

    def unscale(self, scale: float) -> None:
        """Divide the node gradient by the fp16 loss scale."""
        for r in self.regions:
            g = r.grad()
            if g is not None:
                g.div_(scale)

    def gradient_finite(self) -> bool:
        """Whether the node gradient is finite everywhere (agreed by every rank)."""
        return self.all_finite()

    def clip_node_gradient(self, max_norm: float) -> float:
        """Clip the node gradient to `max_norm` by its global L2 norm; returns the norm before."""
        return self.clip_gradients(max_norm)

    def gradient_ready(self) -> None:
        """The node gradient is final: make the parameters' `.grad` hold it (the optimizer reads them)."""

    # --- the plan chunks a training rank exchanges ------------------------------------------
    def use_plan(self, plan: ShardPlan) -> None:
        """The parameter-server plan whose chunks this rank exchanges (made from the whole model)."""
        self._plan, self._slots = plan, None

    @property
    def plan(self) -> ShardPlan:
        assert self._plan is not None, "use_plan() first"
        return self._plan

    def _chunk_slots(self) -> dict[int, tuple[Region, int]]:
        """Which plan chunk lies where in this rank's regions: chunk index -> (region, offset in it).

        Raises:
            ConfigError: a region is not made of whole chunks (the plan was cut for another layout).
        """
        if self._slots is not None:
            return self._slots
        by_start = {c.flat_offset: c for c in self.plan.chunks}
        slots: dict[int, tuple[Region, int]] = {}
        for r in self.regions:
            pos, end = r.flat_offset, r.flat_offset + r.numel
            while pos < end:
                c = by_start.get(pos)
                if c is None or pos + c.numel > end:
                    raise ConfigError("parallelism", f"{self.kind} rank {self.rank} of {self.world} holds {r.name} "
                                      f"[{r.flat_offset}, {end}) of the flat vector, which is not made of whole "
                                      "chunks of the parameter-server plan")
                slots[c.index] = (r, pos - r.flat_offset)
                pos += c.numel
        self._slots = slots
        return slots

    def chunks(self) -> list[Chunk]:
        """The plan chunks this rank exchanges: exactly those of its own regions."""
        return [self.plan.chunks[i] for i in sorted(self._chunk_slots())]

    def chunk_grads(self) -> dict[int, torch.Tensor]:
        """This rank's node gradient by chunk index (on CPU)."""
        out: dict[int, torch.Tensor] = {}
        for idx, (r, start) in self._chunk_slots().items():
            n = self.plan.chunks[idx].numel
            g = r.grad()
            out[idx] = g[start : start + n].cpu() if g is not None else torch.zeros(n)
        return out

    def _chunk_views(self) -> dict[int, torch.Tensor]:
        """This rank's chunks as views of its parameters (on the device), by chunk index."""
        return {idx: r.local()[start : start + self.plan.chunks[idx].numel]
                for idx, (r, start) in self._chunk_slots().items()}

    def chunk_values(self) -> dict[int, torch.Tensor]:
        """Copies of the current values of this rank's chunks (on CPU), by chunk index."""
        return {idx: v.detach().to("cpu", copy=True) for idx, v in self._chunk_views().items()}

    def write_chunks(self, values: dict[int, torch.Tensor], done: bool) -> bool:
        """Write fresh values of this rank's chunks into its parameters; returns `done` as the ranks
        agreed on it (sharded layouts agree elsewhere, with their progress)."""
        slots = self._chunk_slots()
        for idx, v in values.items():
            r, start = slots[idx]
            r.local()[start : start + v.numel()].copy_(v.reshape(-1).to(self.device))
        return done

    def snapshot(self) -> Any:
        """The values an inner round starts from (DiLoCo), to take its pseudo-gradient against."""
        return self.chunk_values()

    def restore(self, snapshot: Any) -> None:
        """Go back to a `snapshot` (a round given up); only a rank holding the whole model does so alone."""
        raise GossamerError(f"a rank of the {self.kind} layout holds part of the model and cannot give a DiLoCo "
                            "round up alone: its ranks give it up together")

    def chunk_delta(self, snapshot: Any) -> dict[int, torch.Tensor]:
        """`snapshot` minus the current values, by chunk index (DiLoCo's pseudo-gradient), in `snapshot`'s
        buffers: no copy of the current values is made (on a GPU, one chunk's at a time)."""
        now = self._chunk_views()
        return {idx: snapshot[idx].sub_(now[idx].cpu()) for idx in snapshot}

    def params_changed(self) -> None:
        """`flat` was written: copy it into the parameters where they are not views of it."""

    def params_stepped(self) -> None:
        """An optimizer stepped the parameters: bring `flat` up to date where it is not their storage."""

    # --- evaluation --------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data: Data, batch: int = 1024, limit: int = 0) -> dict[str, float]:
        """eval_loss (mean per prediction), and eval_accuracy / eval_perplexity where they apply, over
        `data` (a stream: its first `limit` samples); every local rank calls it."""
        self.module.eval()
        totals = EvalTotals(self.objective)
        try:
            for sel in data.eval_selections(batch, limit):
                for b, out in self._eval_batches(data, sel):
                    totals.add(out, b)
        finally:
            self.module.train()
        if self.world > 1 and self._eval_is_split():
            dist.all_reduce(totals.sums)
        return totals.metrics()

    def _eval_is_split(self) -> bool:
        return False

    def _eval_batches(self, data: Data, sel: Selection) -> Iterator[tuple[Any, Any]]:
        b = to_device(data.batch(sel), self.device)
        yield b, self.objective.forward(self.module, b)

    # --- state ---------------------------------------------------------------------------
    def read_flat(self) -> dict[int, torch.Tensor]:
        """This rank's region values by flat offset (copies, on CPU)."""
        return {r.flat_offset: r.local().detach().cpu().clone() for r in self.owned_regions()}


def _tied_aliases(module: nn.Module) -> list[tuple[str, str]]:
    """(alias, first name) of every parameter reachable under more than one name (tied embeddings)."""
    first: dict[int, str] = {}
    aliases = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return aliases


def _materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """Allocate a module built on the meta device (this rank's part only); its values are unset."""
    if any(p.is_meta for p in module.parameters()):
        aliases = _tied_aliases(module)
        module.to_empty(device=device)
        # to_empty gives every module a Parameter of its own: tie each alias back to its first name's.
        for alias, name in aliases:
            owner, _, attr = alias.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(name))
        with torch.no_grad():
            for p in module.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).zero_()  # never garbage, until the first pull
    return module


def _own_units(model: nn.Module) -> list[nn.Module]:
    """The children to shard as FSDP units of their own: those with parameters that share none with another child.

    A tied parameter (GPT-2's lm_head.weight is transformer.wte.weight) must lie in one unit,
    so the children holding it are left to the root's.
    """
    holders: dict[int, int] = {}
    for child in model.children():
        for p in child.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    own = []
    for child in model.children():
        params = list(child.parameters())
        if params and all(holders[id(p)] == 1 for p in params):
            own.append(child)
    return own


class FsdpLayout(NodeLayout):
    """FSDP2: every parameter sharded on dim 0 across the node's local ranks (`fully_shard`).

    Each layer with parameters is its own FSDP unit, so only one layer is gathered at a
    time in forward and backward; the gradient arrives reduce-scattered, each rank holding
    its own rows, which are exactly what it exchanges with other nodes.
    """

    kind = "fsdp"

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.world > FSDP_MAX_LOCAL_RANKS:
            raise ConfigError("parallelism", f"fsdp supports at most {FSDP_MAX_LOCAL_RANKS} local ranks per node "
                                             f"(the parameter-server plan is cut for those), got {self.world}")
        if self.world == 1:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.device.type == "cpu":
            mmap_large_allocations()

        mesh = init_device_mesh(self.device.type, (self.world,))
        for child in _own_units(model):
            fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _materialize(model, self.device)

    def forward_backward(self, batch: Any, denom: float, loss_scale: float = 1.0) -> tuple[float, int]:
        # FSDP's reduce-scatter averages over ranks, but each rank's loss is already its share
        # of the node mean: scale by the world so the average is the sum (as ddp's all-reduce).
        # (`set_gradient_divide_factor(1.0)` says the same, but gloo lacks the PREMUL_SUM it uses.)
        return super().forward_backward(batch, denom, loss_scale * self.world)

    def _regions(self) -> list[Region]:
        regions = []
        for name, p in self.module.named_parameters():
            if self.world == 1:
                regions.append(Region(name, self.full_offsets[name], p.numel(), p))
                continue
            local = p.to_local()  # type: ignore[attr-defined]  # a DTensor once fully_shard ran
            if local.numel() == 0:
                continue
            rows = p.shape[0] if p.dim() else 1
            per_row = p.numel() // max(1, rows)
            start_row = self.rank * -(-rows // self.world)
            regions.append(Region(name, self.full_offsets[name] + start_row * per_row, local.numel(), p))
        return regions

    @property
    def holds_full_model(self) -> bool:
        return self.world == 1

    def reduce_gradients(self) -> None:
        pass  # FSDP reduce-scattered them in backward

    def _eval_is_split(self) -> bool:
        return self.world > 1

    def _eval_batches(self, data: Data, sel: Selection) -> Iterator[tuple[Any, Any]]:
        # Every rank must run the same number of forwards (each gathers layers collectively):
        # each takes an equal slice of the batch, and a rank with an empty slice still runs one.
        mine = even_split(sel, self.world, self.rank)
        b = to_device(data.batch(mine if len(mine) else sel[:1]), self.device)
        out = self.objective.forward(self.module, b)
        if len(mine):
            yield b, out


class PipelineLayout(NodeLayout):
    """torch.distributed.pipelining: the model's layers cut into one stage per local rank.

    Each node batch is split into `pipeline_microbatches` micro-batches and run with the
    GPipe or 1F1B schedule (`pipeline_schedule`). A stage holds, exchanges and checkpoints
    only its own layers' parameters.
    """

    kind = "pipeline"
    splits_batch = False  # every stage sees the whole node batch

    def rank_share(self, sel: Selection) -> Selection:
        return sel

    def _wrap(self, model: nn.Module) -> nn.Module:
        groups = pipeline_split(model, self.world)
        self.groups = groups
        names = list(dict(model.named_children()))
        keep = [names[i] for i in groups[self.rank]]
        stage = nn.Sequential()
        for n in keep:
            stage.add_module(n, getattr(model, n))  # the full model's names: "2.weight" stays "2.weight"
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self._schedule: Any = None
        return _materialize(stage, self.device)

    def _regions(self) -> list[Region]:
        return [Region(n, self.full_offsets[n], p.numel(), p) for n, p in self.module.named_parameters()]

    @property
    def holds_full_model(self) -> bool:
        return self.world == 1

    def reduce_gradients(self) -> None:
        pass

    def _build_schedule(self, denom_ref: list[float], scale_ref: list[float]) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self.module, self.rank, self.world, self.device)

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            total, _ = self.objective.target_loss_sum(out, y)
            return total * (scale_ref[0] / denom_ref[0])

        cls = Schedule1F1B if self.exp.pipeline_schedule == "1f1b" else ScheduleGPipe
        return cls(stage, self.exp.pipeline_microbatches, loss_fn=loss_fn, scale_grads=False)

    def forward_backward(self, batch: Any, denom: float, loss_scale: float = 1.0) -> tuple[float, int]:
        if self.world == 1:
            return super().forward_backward(batch, denom, loss_scale)
        x, y = self._tensors(batch)
        if self._schedule is None:
            self._denom, self._scale = [denom], [loss_scale]
            self._schedule = self._build_schedule(self._denom, self._scale)
        self._denom[0], self._scale[0] = denom, loss_scale
        losses: list[torch.Tensor] = []
        with self.autocast():
            if self.first:
                self._schedule.step(x)
            elif self.last:
                self._schedule.step(target=y, losses=losses)
            else:
                self._schedule.step()
        # Only the last stage saw the loss: share it (and the prediction count) with the others.
        summed = sum(float(v.detach()) for v in losses) * denom / loss_scale if self.last else 0.0
        k = self.objective.predictions(batch)
        shared = torch.tensor([summed], dtype=torch.float64)
        dist.broadcast(shared, src=self.world - 1)
        return float(shared[0]), k

    def _eval_batches(self, data: Data, sel: Selection) -> Iterator[tuple[Any, Any]]:
        if self.world == 1:
            yield from super()._eval_batches(data, sel)
            return
        b = to_device(data.batch(sel), self.device)
        x, _ = self._tensors(b)
        act = x if self.first else self._recv(self.rank - 1)
        out = self.module(act)
        if not self.last:
            self._send(out, self.rank + 1)
            return
        yield b, out.float()

    def _tensors(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The (input, target) tensors of a batch: the only batches a pipeline can cut into micro-batches."""
        x, y = self.objective.split(batch)
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise ConfigError("parallelism", "pipeline cuts (input tensor, target tensor) batches into micro-batches; "
                                             f"this batch gives a {type(x).__name__} input (use ddp or fsdp)")
        return x, y

    def _eval_is_split(self) -> bool:
        return self.world > 1  # only the last stage counts; the sum carries its figures to all

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().float().contiguous()
        header = torch.zeros(9, dtype=torch.int64)
        header[0] = t.dim()
        header[1 : 1 + t.dim()] = torch.tensor(t.shape)
        dist.send(header, dst)
        dist.send(t.cpu() if self.device.type == "cpu" else t, dst)

    def _recv(self, src: int) -> torch.Tensor:
        header = torch.zeros(9, dtype=torch.int64)
        dist.recv(header, src)
        shape = tuple(int(d) for d in header[1 : 1 + int(header[0])])
        t = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.recv(t, src)
        return t


class ReplicatedLayout(NodeLayout):
    """ddp: every local rank holds the whole model and all-reduces its gradient.

    Parameters and gradients are views of two flat fp32 buffers (`flat`, `flat_grad`), as DDP
    buckets are, so exchanging the whole model or a slice of it with other nodes needs no
    copies. A node checkpoint has each rank save an even slice of the model.
    """

    def __init__(self, model: nn.Module, exp: Experiment, rank: int, world: int, device: torch.device) -> None:
        super().__init__(model, exp, rank, world, device)
        self.flat = flatten_params(self.module).to(device)
        self.flat_grad: torch.Tensor | None = None
        self._views = False  # parameters and gradients are views of `flat` and `flat_grad`
        self._grad_released = False  # `release_gradients` freed the gradient views: the next backward binds new ones
        self._no_flat_grad = False  # `step_in_backward`: gradients are per parameter, stepped and freed in backward
        self._grad = torch.zeros(0)  # the node gradient of the last step (`flat_grad` or a copy)
        self._grad_copied = False  # `_grad` is a copy that was changed: `.grad` must be given it
        self._views_checked = False
        self._bind_flat()

    def _bind_flat(self) -> None:
        """Make parameters and gradients views of two flat fp32 buffers (as DDP buckets do).

        Fresh values are then written straight into the parameters and the gradient is
        already flat after backward: no per-step flatten/unflatten copies.
        """
        params = [p for _, p in self.module.named_parameters()]
        if not params or any(p.dtype != torch.float32 for p in params):
            return  # mixed dtypes: keep the copying path
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.flat[offset : offset + n].view_as(p)
            offset += n
        self._views = True
        self._bind_grad()

    def _bind_grad(self) -> None:
        """A zeroed flat gradient buffer, every parameter's `.grad` a view of it."""
        self.flat_grad = torch.zeros_like(self.flat)
        offset = 0
        for p in self.module.parameters():
            n = p.numel()
            p.grad = self.flat_grad[offset : offset + n].view_as(p)
            offset += n
        self._grad_released = False

    def release_gradients(self) -> None:
        """Free the flat gradient (and every `.grad`) until the next `node_gradient` binds a fresh one."""
        self._grad_released = self._views
        self.module.zero_grad(set_to_none=True)
        self.flat_grad = None
        self._grad = torch.zeros(0)

    def step_in_backward(self) -> None:
        """An optimizer steps each parameter inside backward and frees its gradient (`StepInBackward`): keep no
        flat gradient buffer, and return none from `node_gradient`. One local rank only (nothing to all-reduce)."""
        if self.world > 1:
            raise ValueError("stepping inside backward needs one local rank: the gradient is all-reduced first")
        self.release_gradients()
        self._no_flat_grad = True

    def _grads_are_views(self) -> bool:
        if self.flat_grad is None:
            return False
        base = self.flat_grad.untyped_storage().data_ptr()
        return all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() == base for p in self.module.parameters()
        )

    # --- a training rank's node gradient ---------------------------------------------------
    def node_gradient(self, batch: Any, denom: int, samples: int, loss_scale: float,
                      before_reduce: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._grad_released and not self._no_flat_grad:
            self._bind_grad()  # zeroed, as zero_grad leaves it
        elif self._views_checked and self.flat_grad is not None:
            self.flat_grad.zero_()  # every .grad is a view of it (checked at the first backward): one kernel
        else:
            self.module.zero_grad(set_to_none=self._no_flat_grad)
        with self.autocast():
            out = self.objective.forward(self.module, batch)
        total, predictions = self.objective.loss_sum(out, batch)
        per_sample = max(1, predictions // max(1, batch_samples(batch)))  # 1 for classifiers, T for sequences
        (total * (loss_scale / (denom * per_sample))).backward()
        if not self._views_checked and self.flat_grad is not None and not self._grads_are_views():
            # Checked once: autograd accumulates in place into an existing .grad, so if the
            # first backward kept the views, later ones do too.
            self.flat_grad, self._views = None, False  # autograd replaced a .grad: fall back to copying
            unflatten_into(self.module, self.flat)
        self._views_checked = True
        if self._no_flat_grad:
            grad = torch.zeros(0)  # stepped and freed parameter by parameter inside backward
        else:
            grad = self.flat_grad if self.flat_grad is not None else flatten_grads(self.module)
        node_samples = torch.tensor([float(samples), total.item() / per_sample])
        self._grad, self._grad_copied = grad, False
        if self.world > 1:
            before_reduce()
            dist.all_reduce(grad)
            dist.all_reduce(node_samples)
            self._grad_copied = True
        return grad, node_samples

    def unscale(self, scale: float) -> None:
        self._grad.div_(scale)
        self._grad_copied = True

    def gradient_finite(self) -> bool:
        return bool(torch.isfinite(self._grad).all())  # every rank holds the same node gradient

    def clip_node_gradient(self, max_norm: float) -> float:
        norm = float(self._grad.double().norm())
        if norm > max_norm:
            self._grad.mul_(max_norm / (norm + 1e-6))
            self._grad_copied = True
        return norm

    def gradient_ready(self) -> None:
        if self.flat_grad is None and self._grad_copied:
            offset = 0
            for p in self.module.parameters():
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(self._grad[offset : offset + n].view_as(p.grad))
                offset += n

    # --- the plan chunks a training rank exchanges ------------------------------------------
    def chunks(self) -> list[Chunk]:
        """A balanced share of every chunk: the node's ranks split the exchange between them."""
        return self.plan.chunks_of_rank(self.rank, self.world)

    def chunk_grads(self) -> dict[int, torch.Tensor]:
        return {c.index: self._grad[c.flat_offset : c.flat_offset + c.numel].cpu() for c in self.chunks()}

    def chunk_values(self) -> dict[int, torch.Tensor]:
        """Copies of this rank's share of the chunks (on CPU): every rank holds the whole model."""
        return {c.index: self.flat[c.flat_offset : c.flat_offset + c.numel].detach().cpu().clone()
                for c in self.chunks()}

    def write_chunks(self, values: dict[int, torch.Tensor], done: bool) -> bool:
        """Every rank writes its own chunks into `flat` and zeroes the others: an all-reduce in place
        gathers them (chunks are disjoint across ranks), with no whole-model buffer."""
        self.plan.scatter(self.flat, values)
        if self.world > 1:
            for c in self.plan.chunks:
                if c.index not in values:
                    self.flat[c.flat_offset : c.flat_offset + c.numel].zero_()
            dist.all_reduce(self.flat)
            flag = torch.tensor([float(done)], device=self.flat.device)
            dist.all_reduce(flag)
            done = bool(flag.item() > 0)
        self.params_changed()
        return done

    def snapshot(self) -> Any:
        return self.flat.clone()

    def restore(self, snapshot: Any) -> None:
        self.flat.copy_(snapshot)
        self.params_changed()

    def chunk_delta(self, snapshot: Any) -> dict[int, torch.Tensor]:
        """As `NodeLayout.chunk_delta`; `snapshot` is `flat` as it was, or values of some of this rank's chunks by
        index (those are the chunks returned)."""
        if isinstance(snapshot, dict):
            chunks = self.plan.chunks
            return {i: v.sub_(self.flat[chunks[i].flat_offset : chunks[i].flat_offset + chunks[i].numel].cpu())
                    for i, v in snapshot.items()}
        delta = snapshot.sub_(self.flat)
        return {c.index: delta[c.flat_offset : c.flat_offset + c.numel] for c in self.chunks()}

    def params_changed(self) -> None:
        if not self._views:
            unflatten_into(self.module, self.flat)

    def params_stepped(self) -> None:
        if not self._views:  # parameter by parameter: no whole-model flattened copy
            offset = 0
            for p in self.module.parameters():
                n = p.numel()
                self.flat[offset : offset + n].copy_(p.detach().reshape(-1))
                offset += n

    # --- node checkpoints ----------------------------------------------------------------------
    def owned_regions(self) -> list[Region]:
        if self.world == 1:
            return self.regions
        lo = self.rank * self.total_numel // self.world
        hi = (self.rank + 1) * self.total_numel // self.world
        out: list[Region] = []
        for r in self.regions:
            a, b = max(lo, r.flat_offset), min(hi, r.flat_offset + r.numel)
            if a < b:
                out.append(_SliceRegion(r.name, a, b - a, r.param, a - r.flat_offset))
        return out


@dataclass(frozen=True)
class _SliceRegion(Region):
    start: int = 0

    def piece(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().view(-1)[self.start : self.start + self.numel]


def make_layout(model: nn.Module, exp: Experiment, rank: int, world: int, device: torch.device) -> NodeLayout:
    """The layout `exp.parallelism` asks for over `world` local ranks."""
    cls: Callable[..., NodeLayout] = {
        "ddp": ReplicatedLayout, "fsdp": FsdpLayout, "pipeline": PipelineLayout,
    }[exp.parallelism]
    return cls(model, exp, rank, world, device)


def shards_model(exp: Experiment, world: int) -> bool:
    """Whether a training rank holds only part of the model (fsdp or pipeline over several local ranks)."""
    return exp.parallelism != "ddp" and world > 1


def rank_layout(model: nn.Module, exp: Experiment, rank: int, world: int, device: torch.device) -> NodeLayout:
    """The layout a training rank runs: sharded or staged over several local ranks, else replicated."""
    if shards_model(exp, world):
        return make_layout(model, exp, rank, world, device)
    return ReplicatedLayout(model, exp, rank, world, device)
