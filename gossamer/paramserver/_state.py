"""A shard's state: its chunks' values, the optimizer over them, the version; export and import for SYNC and checkpoints."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gossamer.checkpoint.sharded import ShardSnapshot, restore_range, verify_step
from gossamer.core.envinfo import fingerprint
from gossamer.core.errors import ConfigError, ProtocolError
from gossamer.core.lr_schedule import lr_multiplier
from gossamer.core.protocol import SyncMeta, chunk_key, parse_chunk_key
from gossamer.engine.shard_plan import Chunk, ShardPlan, chunk_groups
from gossamer.paramserver._copy_on_write import WritesAside, storage_of
from gossamer.paramserver._reject import Reject
from gossamer.paramserver._snapshot import PendingSnapshot
from gossamer.paramserver.delayed_nesterov import DelayedNesterov
from gossamer.paramserver.optimizer import build_optimizer, set_lr_factor
from gossamer.paramserver.optimizer import step as optimizer_step
from gossamer.paramserver.shard_config import ShardConfig

__all__ = ["STEP_GROUP_BYTES", "ShardState"]

_ENV: dict[str, Any] = {}
#: A step taken from a function of the chunks (`ShardState.step`) asks for this many bytes of gradients at most.
STEP_GROUP_BYTES = 16 << 20
#: Seconds in a row updates are kept back while replies still send the live values (a worker's PARAMS, a
#: backup's SYNC): applied then, an update writes those values out of place, a copy of the shard beside
#: the one on its way out. Past it (a slow link, or a reader that never reads) updates go on, writing aside.
LENT_HOLD_S = 1.0


def _environment() -> dict[str, Any]:
    """This process's environment fingerprint, stored with each shard checkpoint (computed once)."""
    if not _ENV:
        _ENV.update(fingerprint())
    return _ENV


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    def clone(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clone(v) for v in x]
        return x

    return clone(state)


class ShardState:
    """The chunks of one shard, their optimizer and version, and which worker updates they hold.

    Not locked: the shard server calls it under its lock.
    """

    def __init__(self, config: ShardConfig, plan: ShardPlan, init: dict[int, torch.Tensor],
                 shapes: dict[str, tuple[int, ...]], *, own_init: bool = False) -> None:
        if config.shard >= plan.num_shards:
            raise ConfigError("shard", f"shard {config.shard} not in a plan of {plan.num_shards}")
        self.config = config
        self.plan = plan
        self.shapes = shapes
        self.chunks: dict[int, Chunk] = {c.index: c for c in plan.chunks_of_shard(config.shard)}
        if not self.chunks:
            raise ConfigError("shard", f"shard {config.shard} holds no chunks in this plan")
        if set(init) != set(self.chunks):
            raise ConfigError("init", f"needs exactly chunks {sorted(self.chunks)}, got {sorted(init)}")
        self.params: dict[int, torch.Tensor] = {}
        for idx, c in sorted(self.chunks.items()):
            value = init[idx].detach().reshape(-1)
            if value.dtype != torch.float32:
                value = value.float()  # a fresh tensor already
            elif not own_init:
                value = value.clone()  # the caller keeps its tensor
            if value.numel() != c.numel:
                raise ConfigError("init", f"chunk {idx} has {value.numel()} elements, not {c.numel}")
            self.params[idx] = value
        self.optimizer = build_optimizer(config.optimizer, list(self.params.values()))
        self.version = 0
        self.updates = 0
        self.apply_s = 0.0  # seconds in optimizer steps
        # Readers of the live values: sends still reading them (anything with `.done`, a ZMQ
        # MessageTracker, and the storages it reads) and a snapshot still pending. A write
        # leaves what they read alone (`writes`).
        self._lent: list[tuple[Any, set[int]]] = []
        self._lent_since: float | None = None  # since when some reply has sent the live values without a break
        # Weak: the copier thread (or whoever opened it) keeps a snapshot alive until it is whole; once
        # handed over, its pieces must not be freed later on the serve thread, nor kept between checkpoints.
        self._pending: list[weakref.ref[PendingSnapshot]] = []
        self.cow_copies = 0  # writes that ran out of place for a send still reading the values
        self.cow_s = 0.0  # the time of those writes (the update's own arithmetic included)
        self.applied: dict[str, int] = {}  # sender -> last applied clock (async) / step (sync)
        #: `ShardConfig.reduce`: the optimizer steps the workers had taken when they pushed the values held.
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.version >= self.config.total_steps

    def set_delay(self, delay: int) -> None:
        """Delayed Nesterov's N from the next step on (the workers the primary serves; its
        backup replays it); other optimizers have none."""
        if isinstance(self.optimizer, DelayedNesterov):
            self.optimizer.set_delay(delay)

    def step(self, grads: dict[int, torch.Tensor] | Callable[[list[int]], dict[int, torch.Tensor]], lr_factor: float,
             *, schedule: bool, groups: list[list[int]] | None = None,
             after_group: Callable[[list[int]], None] | None = None) -> float:
        """One optimizer step with `grads` (every chunk); returns the lr factor applied.

        `grads` a function of chunk indices (their gradients): the step is taken a group of at most
        `STEP_GROUP_BYTES` of chunks at a time, each group's gradient asked for, stepped and dropped
        before the next (the optimizers are elementwise: the same bits as one step). `groups`: these
        groups of chunks instead (together every chunk once); `after_group(group)` is called once each
        is stepped (its values final). `schedule`: multiply in the lr schedule at this version (a
        primary does; its backup replays the factor it is sent).
        """
        t0 = time.perf_counter()
        if schedule:
            lr_factor *= lr_multiplier(self.version, self.config.total_steps, self.config.lr_schedule,
                                       self.config.warmup_steps)
        set_lr_factor(self.optimizer, self.config.optimizer.lr, lr_factor)
        if groups is not None:
            if sorted(i for group in groups for i in group) != sorted(self.params):
                raise ValueError("step groups must hold every chunk of the shard once")
        elif callable(grads):
            groups = chunk_groups(sorted(self.params), self.chunks, STEP_GROUP_BYTES)
        else:
            groups = [sorted(self.params)]
        with self.writes():
            for group in groups:
                part = grads(group) if callable(grads) else grads
                for idx in group:
                    self.params[idx].grad = part[idx]
                del part
                optimizer_step(self.optimizer)
                for idx in group:
                    self.params[idx].grad = None
                if after_group is not None:
                    after_group(group)
        self.version += 1
        self.updates += 1
        self.apply_s += time.perf_counter() - t0
        return lr_factor

    def assign(self, values: dict[int, torch.Tensor], steps: int) -> None:
        """Take `values` (every chunk), pushed by workers `steps` optimizer steps in, as the next version's: a
        train function's sync, whose workers step their own optimizer (`ShardConfig.reduce`)."""
        t0 = time.perf_counter()
        self.steps = steps
        with self.writes():
            for idx, value in values.items():
                self.params[idx].copy_(value)
        self.version += 1
        self.updates += 1
        self.apply_s += time.perf_counter() - t0

    # -- readers of the live values -----------------------------------------------------
    def lend(self, reader: Any, tensors: Iterable[torch.Tensor] = (), *, values: bool = True) -> None:
        """A send reads the live chunk values (and `tensors`, e.g. the optimizer's state) until `reader.done`
        (values sent without a copy). `values` False: only `tensors` (a part of a SYNC, its chunks' values
        among them)."""
        lent = (*self.params.values(), *tensors) if values else tuple(tensors)
        self._lent.append((reader, {storage_of(p) for p in lent}))

    @contextmanager
    def writes(self) -> Iterator[None]:
        """Change the state inside this: the storages a send or a pending snapshot still reads
        are written out of place (`WritesAside`: the same arithmetic into new memory, no copy),
        everything else in place."""
        self._lent = [(r, ptrs) for r, ptrs in self._lent if not r.done]
        lent = set().union(*(ptrs for _, ptrs in self._lent))
        pendings = self._pendings()
        frozen = lent.union(*(p.frozen() for p in pendings))
        if not frozen:
            yield
            return
        t0 = time.perf_counter()
        release = None
        if len(pendings) == 1:  # a piece the writer has written (or will, shortly) is written in place
            pending = pendings[0]

            def release(ptr: int) -> set[int]:
                return set() if ptr in lent else pending.release(ptr)

        mode = WritesAside(frozen, release)
        with mode:
            yield
        if lent:
            self.cow_copies += 1
            self.cow_s += time.perf_counter() - t0
        for p in pendings:
            p.note_write(mode.copies, mode.copy_s)
        del pendings
        self._pendings()

    def holds_back(self, now: float) -> bool:
        """Whether an update should wait: now it would wait for a checkpoint's writer
        (`PendingSnapshot.holds_back`), or write aside the values a reply still sends (`LENT_HOLD_S`)."""
        if any(p.holds_back(now) for p in self._pendings()):
            return True
        self._lent = [(r, ptrs) for r, ptrs in self._lent if not r.done]
        if not self._lent:
            self._lent_since = None
            return False
        if self._lent_since is None:
            self._lent_since = now
        return now - self._lent_since < LENT_HOLD_S

    def _pendings(self) -> list[PendingSnapshot]:
        """The snapshots still pending (forgets the rest)."""
        alive = [p for r in self._pending if (p := r()) is not None and not p.done]
        self._pending = [weakref.ref(p) for p in alive]
        return alive

    def open_snapshot(self, step: int, **limits: Any) -> PendingSnapshot:
        """This version's state for a checkpoint, written from the live tensors (`PendingSnapshot`, `limits` its
        `aside_bytes` and `wait_s`): give its `snapshot` to a writer (`save_shard`), or `close` it."""
        layout = [(name, list(self.shapes.get(name, (numel,)))) for name, numel in self.plan.params]
        skeleton = ShardSnapshot(
            experiment=self.config.experiment, step=step, shard=self.config.shard,
            num_shards=self.plan.num_shards, total_numel=self.plan.total_numel, version=self.version,
            pieces={}, scalars={}, layout=layout, extra={"applied": dict(self.applied), "env": _environment()},
        )
        sources = [(c.flat_offset, self.params[idx], dict(self.optimizer.state.get(self.params[idx], {})))
                   for idx, c in sorted(self.chunks.items())]
        pending = PendingSnapshot(skeleton, sources, **limits)
        self._pending = [*(weakref.ref(p) for p in self._pendings()), weakref.ref(pending)]
        return pending

    def remember(self, applied: list[tuple[str, int]] | tuple[tuple[str, int], ...], *, latest: bool) -> None:
        """Note the worker updates a version covered (`latest`: keep the highest seen)."""
        for sender, key in applied:
            self.applied[sender] = max(self.applied.get(sender, -1), key) if latest else key

    # -- export and import --------------------------------------------------------------
    def export(self, *, copy: bool = True) -> tuple[SyncMeta, dict[str, torch.Tensor]]:
        """Chunk values and optimizer state as tensors ("c3", "c3/momentum_buffer") + meta.

        `copy` False: the live tensors themselves (a SYNC sent without a copy of the state, `lend`ed
        to the send until ZMQ lets go of them, so a step meanwhile writes aside)."""
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, float] = {}
        opt = self.optimizer.state_dict()["state"]
        for i, idx in enumerate(sorted(self.params)):
            tensors[chunk_key(idx)] = self.params[idx].clone() if copy else self.params[idx].detach()
            for name, val in opt.get(i, {}).items():
                if isinstance(val, torch.Tensor) and val.dim() > 0:
                    tensors[f"{chunk_key(idx)}/{name}"] = val.detach().clone() if copy else val.detach()
                elif isinstance(val, torch.Tensor):
                    scalars[f"{idx}/{name}"] = float(val.item())
                elif isinstance(val, int | float):
                    scalars[f"{idx}/{name}"] = float(val)
        return SyncMeta(state_version=self.version, applied=dict(self.applied), scalars=scalars), tensors

    def load(self, meta: SyncMeta, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the whole state with an exported one (raises Reject if it does not fit).

        Takes the optimizer-state tensors over (a SYNC's received buffers, a checkpoint just
        read): the caller must not use them again. Chunk values are copied into place.
        """
        for idx, c in self.chunks.items():
            t = tensors.get(chunk_key(idx))
            if t is None or t.numel() != c.numel:
                raise Reject(f"state lacks chunk {idx} or has the wrong size")
        self.load_chunks(meta, tensors)
        self.finish_load(meta)

    def load_chunks(self, meta: SyncMeta, tensors: dict[str, torch.Tensor]) -> list[int]:
        """Replace the values and optimizer state of the chunks whose values `tensors` carries ("c3",
        with "c3/<state>"), as `load` does; the other chunks stay as they are. Returns those chunks.
        Raises Reject for a chunk not on this shard, a wrong size, or a state tensor of a chunk it
        does not carry. The version is unchanged (`finish_load`): a SYNC in parts loads them one by one.
        """
        carried: dict[int, str] = {}
        for name in tensors:
            if "/" not in name:
                idx = _chunk_of(name)
                if idx is None or idx not in self.chunks:
                    raise Reject(f"state tensor {name!r} is no chunk of this shard")
                carried[idx] = name
        entries: dict[int, dict[str, Any]] = {idx: {} for idx in carried}
        for name, t in tensors.items():
            if "/" not in name:
                if t.numel() != self.chunks[parse_chunk_key(name)].numel:  # a key `carried` checked
                    raise Reject(f"state lacks chunk {name} or has the wrong size")
                continue
            head, _, rest = name.partition("/")
            idx = _chunk_of(head)
            if idx is None or idx not in entries or not rest:
                raise Reject(f"state tensor {name!r} belongs to no chunk it carries")
            if t.numel() != self.chunks[idx].numel:
                raise Reject(f"state tensor {name} has the wrong size")
            entries[idx][rest] = t.detach().reshape(-1).to(torch.float32)
        for key, val in meta.scalars.items():
            head, _, rest = key.partition("/")
            if head.isdigit() and int(head) in entries and rest:
                entries[int(head)][rest] = torch.tensor(float(val))
        with self.writes():
            for idx, name in carried.items():
                param = self.params[idx]
                param.copy_(tensors[name].reshape(-1))
                if entries[idx]:
                    self.optimizer.state[param] = entries[idx]
                else:
                    self.optimizer.state.pop(param, None)
        return sorted(carried)

    def finish_load(self, meta: SyncMeta) -> None:
        """The version and applied clocks of a loaded state (after every `load_chunks` of it)."""
        self.version = int(meta.state_version)
        self.applied = dict(meta.applied)

    # -- checkpoints --------------------------------------------------------------------
    def snapshot(self, step: int) -> ShardSnapshot:
        """This shard's state for a sharded checkpoint (copies)."""
        meta, tensors = self.export()
        pieces: dict[int, dict[str, torch.Tensor]] = {}
        scalars: dict[int, dict[str, float]] = {}
        for idx, c in self.chunks.items():
            key = chunk_key(idx)
            entry = {"param": tensors[key]}
            entry.update({n.split("/", 1)[1]: t for n, t in tensors.items() if n.startswith(f"{key}/")})
            pieces[c.flat_offset] = entry
            sc = {k.split("/", 1)[1]: v for k, v in meta.scalars.items() if k.split("/", 1)[0] == str(idx)}
            if sc:
                scalars[c.flat_offset] = sc
        layout = [(name, list(self.shapes.get(name, (numel,)))) for name, numel in self.plan.params]
        return ShardSnapshot(
            experiment=self.config.experiment, step=step, shard=self.config.shard,
            num_shards=self.plan.num_shards, total_numel=self.plan.total_numel, version=self.version,
            pieces=pieces, scalars=scalars, layout=layout, extra={"applied": meta.applied, "env": _environment()},
        )

    def read_checkpoint(self, step_dir: str) -> tuple[SyncMeta, dict[str, torch.Tensor]]:
        """This shard's chunks from a sharded checkpoint (any number of shards saved it), as an export.

        Raises CheckpointError if the checkpoint fails its checks.
        """
        manifests = verify_step(step_dir)
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, float] = {}
        versions = []
        for idx, c in sorted(self.chunks.items()):
            states, sc, version = restore_range(step_dir, c.flat_offset, c.numel, manifests)
            key = chunk_key(idx)
            tensors[key] = states.pop("param")
            tensors.update({f"{key}/{name}": t for name, t in states.items()})
            scalars.update({f"{idx}/{name}": v for name, v in sc.items()})
            versions.append(version)
        applied: dict[str, int] = {}
        for m in manifests:
            for sender, clock in (m.get("extra") or {}).get("applied", {}).items():
                applied[sender] = max(applied.get(sender, -1), int(clock))
        return SyncMeta(state_version=min(versions), applied=applied, scalars=scalars), tensors

    def state_dict(self) -> dict[str, Any]:
        """Chunk values, optimizer state and version, for checkpointing."""
        return {
            "experiment": self.config.experiment,
            "shard": self.config.shard,
            "plan_fingerprint": self.plan.fingerprint(),
            "version": self.version,
            "values": {idx: p.clone() for idx, p in self.params.items()},
            "optimizer": _clone_state(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (same plan and shard)."""
        if state.get("plan_fingerprint") != self.plan.fingerprint():
            raise ConfigError("plan", "checkpoint was taken with a different shard plan")
        with self.writes():
            for idx, p in self.params.items():
                p.copy_(state["values"][idx])
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])


def _chunk_of(name: str) -> int | None:
    """The chunk index of a chunk key ("c3"), None for any other name."""
    try:
        return parse_chunk_key(name)
    except ProtocolError:
        return None
