"""The Experiment: one validated, frozen description of a training run (TOML, CLI and RPC map onto it)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossamer.errors import ConfigError
from gossamer.gossip.topology import TOPOLOGIES
from gossamer.lr_schedule import LR_SCHEDULES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODES = ("sync", "async", "gossip", "diloco")
#: Modes this release runs end to end; the others are accepted by the parser but refused at submit.
IMPLEMENTED_MODES = ("sync", "async", "gossip", "diloco")
OPTIMIZERS = ("sgd", "adamw")
OUTER_STEPS = ("sync", "async", "gossip")
#: Gossip exchanges parameter values: only codecs whose decode approximates the value itself.
#: Sparse and sign codecs would need a reference both ends share (CHOCO-SGD), not built here.
GOSSIP_CODECS = re.compile(r"^(none|fp16|bf16|int8|qsgd:\d+)$")
PARALLELISMS = ("ddp", "fsdp", "pipeline")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCALINGS = ("none", "linear")
# Used with fullmatch: `$` alone also matches before a trailing newline. ASCII digits, at most
# nine, exactly what gossamer.compression.parse_codec accepts.
_COMPRESSION = re.compile(
    r"none|fp16|bf16|int8|sign|adaptive|qsgd:[0-9]{1,9}|topk:(0?\.[0-9]+|1(\.0*)?|[0-9]+e-[0-9]+)"
    r"|powersgd:[0-9]{1,9}"
)
_CALLABLE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
#: Integers travel through TOML, SQLite and msgpack: all three stop at 64 bits.
_INT64 = 1 << 63
_MAX_DEPTH = 32


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A training run. Every field has a default except `name`, `model` and `dataset`.

    `model` and `dataset` are "module:callable" paths; the model callable returns an
    nn.Module (called with `model_args`), the dataset callable a (train, eval) pair of
    map-style Datasets yielding (input, target) (called with `dataset_args`).
    `batch_size` is per worker node; in sync mode `global_batch_size`, when set, fixes the
    global batch and splits it over the current workers.
    """

    name: str
    model: str
    dataset: str
    model_args: dict[str, Any] = field(default_factory=dict)
    dataset_args: dict[str, Any] = field(default_factory=dict)
    mode: str = "async"
    compression: str = "auto"  # "auto": int8 for diloco's pseudo-gradients, none otherwise
    compression_overrides: dict[str, str] = field(default_factory=dict)
    pull_compression: str = "none"
    adaptive_target_share: float = 0.2
    optimizer: str = "auto"  # "auto": adamw for diloco's inner steps, sgd otherwise
    lr: float = 0.05
    lr_schedule: str = "constant"  # constant | linear | cosine (decay to 0 at total_steps)
    warmup_steps: int = 0
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    batch_size: int = 32
    global_batch_size: int | None = None
    staleness: int | None = None
    lr_staleness_scaling: bool = True
    overlap: bool = False
    num_ps_shards: int = 1
    ps_backup: bool = True
    min_workers: int = 1
    max_workers: int = 16
    total_steps: int = 1000
    eval_every: int = 100
    checkpoint_every: int = 0
    checkpoint_dir: str = ""
    seed: int = 0
    inner_steps: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_step: str = "sync"
    topology: str = "exponential"
    parallelism: str = "ddp"  # inside a node: ddp | fsdp | pipeline (gossamer/worker/layout.py)
    pipeline_microbatches: int = 4
    pipeline_schedule: str = "gpipe"  # gpipe | 1f1b
    precision: str = "fp32"  # fp32 | bf16 (autocast, CPU and CUDA) | fp16 (autocast + loss scaling, CUDA)
    max_grad_norm: float = 0.0  # > 0: clip each node's gradient to this global L2 norm
    lr_scaling: str = "none"  # none | linear: lr x (batch per update / base_batch_size)
    base_batch_size: int = 0  # the batch `lr` was tuned for (0: batch_size)
    chunk_numel: int = 1 << 20
    profile_steps: int = 0  # > 0: a torch.profiler trace of this many steps (gossamer/worker/profiling.py)
    profile_start: int = 5  # each profiled rank's own step at which the trace starts
    profile_nodes: list[str] = field(default_factory=list)  # node names or ids; empty: every worker

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ConfigError:
            return ConfigError(name, msg)

        # First, so no check below meets a value it cannot compare or convert.
        for fld in dataclasses.fields(self):
            problem = _wire_problem(getattr(self, fld.name), want_bool=fld.type == "bool")
            if problem:
                raise bad(fld.name, problem)
        if not isinstance(self.name, str) or not self.name.strip():
            raise bad("name", "must be a non-empty string")
        for f in ("model", "dataset"):
            v = getattr(self, f)
            if not isinstance(v, str) or not _CALLABLE.fullmatch(v):
                raise bad(f, f"must look like 'package.module:callable', got {v!r}")
        for f in ("model_args", "dataset_args"):
            if not isinstance(getattr(self, f), dict):
                raise bad(f, "must be a table/dict")
        if self.mode not in MODES:
            raise bad("mode", f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        # Mode-dependent defaults are resolved here, so every copy (TOML, JSON, RPC) agrees.
        if self.compression == "auto":
            object.__setattr__(self, "compression", "int8" if self.mode == "diloco" else "none")
        if self.optimizer == "auto":
            object.__setattr__(self, "optimizer", "adamw" if self.mode == "diloco" else "sgd")
        _check_codec("compression", self.compression, allow_adaptive=True)
        _check_codec("pull_compression", self.pull_compression, allow_adaptive=False)
        if not isinstance(self.compression_overrides, dict):
            raise bad("compression_overrides", "must map a parameter-name pattern to a codec")
        for pattern, spec in self.compression_overrides.items():
            if not isinstance(pattern, str) or not pattern:
                raise bad("compression_overrides", f"pattern {pattern!r} must be a non-empty string")
            _check_codec("compression_overrides", spec, allow_adaptive=False)
        if _not_number(self.adaptive_target_share) or not 0 < self.adaptive_target_share <= 10:
            raise bad("adaptive_target_share", f"must be in (0, 10], got {self.adaptive_target_share!r}")
        if self.optimizer not in OPTIMIZERS:
            raise bad("optimizer", f"unknown optimizer {self.optimizer!r}; choose {', '.join(OPTIMIZERS)}")
        for f in ("lr", "outer_lr"):
            v = getattr(self, f)
            if _not_number(v) or not math.isfinite(v) or v <= 0:
                raise bad(f, f"must be a finite number > 0, got {v!r}")
        for f in ("momentum", "outer_momentum", "weight_decay"):
            v = getattr(self, f)
            if _not_number(v) or not math.isfinite(v) or v < 0 or (f != "weight_decay" and v >= 1):
                raise bad(f, f"must be in [0, 1), got {v!r}")
        if self.nesterov and self.momentum == 0:
            raise bad("nesterov", "needs momentum > 0")
        for f in ("batch_size", "num_ps_shards", "min_workers", "max_workers", "total_steps",
                  "inner_steps", "chunk_numel"):
            if not _positive_int(getattr(self, f)):
                raise bad(f, f"must be an integer >= 1, got {getattr(self, f)!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise bad("lr_schedule", f"unknown lr schedule {self.lr_schedule!r}; choose {', '.join(LR_SCHEDULES)}")
        for f in ("eval_every", "checkpoint_every", "seed", "warmup_steps"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(f, f"must be an integer >= 0, got {v!r}")
        if not isinstance(self.ps_backup, bool):
            raise bad("ps_backup", f"must be true or false, got {self.ps_backup!r}")
        if self.warmup_steps >= self.total_steps:
            raise bad("warmup_steps", f"must be < total_steps ({self.total_steps}), got {self.warmup_steps}")
        if self.max_workers < self.min_workers:
            raise bad("max_workers", f"must be >= min_workers ({self.min_workers})")
        if self.global_batch_size is not None:
            if not _positive_int(self.global_batch_size):
                raise bad("global_batch_size", "must be an integer >= 1 or unset")
            if self.mode != "sync":
                raise bad("global_batch_size", "only applies to mode='sync'")
            if self.global_batch_size < self.min_workers:
                raise bad("global_batch_size", "must be >= min_workers (one sample per worker)")
        if self.staleness is not None and (
            not isinstance(self.staleness, int) or isinstance(self.staleness, bool) or self.staleness < 0
        ):
            raise bad("staleness", f"must be an integer >= 0 or None, got {self.staleness!r}")
        if self.overlap and self.mode not in ("async", "gossip"):
            raise bad("overlap", "only applies to mode='async' or 'gossip' (sync waits for every worker each step)")
        if self.outer_step not in OUTER_STEPS:
            raise bad("outer_step", f"unknown outer step {self.outer_step!r}; choose {', '.join(OUTER_STEPS)}")
        if self.mode == "gossip" or (self.mode == "diloco" and self.outer_step == "gossip"):
            for f, spec in [("compression", self.compression), ("pull_compression", self.pull_compression),
                            *(("compression_overrides", v) for v in self.compression_overrides.values())]:
                if not GOSSIP_CODECS.match(spec):
                    raise bad(f, f"gossip exchanges parameter values, so {spec!r} does not apply; use "
                                 "none|fp16|bf16|int8|qsgd:L (sparse/sign codecs need a shared reference)")
        if self.topology not in TOPOLOGIES:
            raise bad("topology", f"unknown topology {self.topology!r}; choose {', '.join(TOPOLOGIES)}")
        if self.parallelism not in PARALLELISMS:
            raise bad("parallelism", f"unknown parallelism {self.parallelism!r}; choose {', '.join(PARALLELISMS)}")
        if self.parallelism != "ddp" and (self.mode == "gossip" or self.outer_step == "gossip"):
            raise bad("parallelism", f"{self.parallelism} runs with the parameter servers (sync, async, diloco with "
                                     "a sync or async outer step); gossip mixes a whole replica on every local rank "
                                     "(use parallelism='ddp')")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise bad("pipeline_schedule", f"unknown schedule {self.pipeline_schedule!r}; choose "
                                           f"{', '.join(PIPELINE_SCHEDULES)}")
        for f in ("pipeline_microbatches",):
            if not _positive_int(getattr(self, f)):
                raise bad(f, f"must be an integer >= 1, got {getattr(self, f)!r}")
        if self.parallelism == "pipeline":
            if self.batch_size % self.pipeline_microbatches:
                raise bad("pipeline_microbatches", f"must divide batch_size ({self.batch_size}), "
                                                   f"got {self.pipeline_microbatches}")
            if self.global_batch_size is not None:
                raise bad("global_batch_size", "pipeline keeps batch_size per worker; leave global_batch_size unset")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"unknown precision {self.precision!r}; choose {', '.join(PRECISIONS)}")
        if _not_number(self.max_grad_norm) or not math.isfinite(self.max_grad_norm) or self.max_grad_norm < 0:
            raise bad("max_grad_norm", f"must be a finite number >= 0 (0: no clipping), got {self.max_grad_norm!r}")
        if self.lr_scaling not in LR_SCALINGS:
            raise bad("lr_scaling", f"unknown lr scaling {self.lr_scaling!r}; choose {', '.join(LR_SCALINGS)}")
        if not isinstance(self.base_batch_size, int) or isinstance(self.base_batch_size, bool) \
                or self.base_batch_size < 0:
            raise bad("base_batch_size", f"must be an integer >= 0 (0: batch_size), got {self.base_batch_size!r}")
        if not isinstance(self.checkpoint_dir, str):
            raise bad("checkpoint_dir", "must be a path string")
        for f in ("profile_steps", "profile_start"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(f, f"must be an integer >= 0, got {v!r}")
        if not isinstance(self.profile_nodes, list) or not all(isinstance(n, str) and n for n in self.profile_nodes):
            raise bad("profile_nodes", "must be a list of node names or ids (empty: every worker)")
        if self.profile_nodes and not self.profile_steps:
            raise bad("profile_nodes", "needs profile_steps > 0")
        if self.profile_steps and self.profile_start + self.profile_steps > self.total_steps:
            raise bad("profile_steps", f"profile_start + profile_steps must be <= total_steps ({self.total_steps})")

    # --- conversions -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Experiment:
        """Build from a plain dict (TOML table, JSON); unknown keys are an error naming them."""
        if not isinstance(data, dict):
            raise ConfigError("experiment", "must be an object/table")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise ConfigError(str(unknown[0]), "unknown field")
        for required in ("name", "model", "dataset"):
            if required not in data:
                raise ConfigError(required, "is required")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Experiment:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # ValueError: also too many digits
            raise ConfigError("experiment", f"not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_toml(
        cls, path: str | os.PathLike[str], overrides: dict[str, Any] | None = None
    ) -> Experiment:
        """Read a TOML experiment file. Precedence: `overrides` (CLI) > GOSSAMER_EXP_* env > file."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as e:
            raise ConfigError("file", f"{p} does not exist") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ConfigError("file", f"{p} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError("file", f"{p} cannot be read: {e.strerror or e}") from None
        table = data.get("experiment", data)
        if not isinstance(table, dict):
            raise ConfigError("experiment", "must be a table")
        data = dict(table)
        data.update(_env_overrides())
        data.update(overrides or {})
        return cls.from_dict(data)

    # --- derived values ----------------------------------------------------------------
    def linear_lr_factor(self, num_workers: int = 1) -> float:
        """The linear scaling rule's lr multiplier: samples per update / `base_batch_size` (1 when off).

        An update is one worker's batch in async, gossip and diloco, and the global batch of
        `num_workers` workers in sync (Goyal et al. 2017; pair it with `warmup_steps`).
        """
        if self.lr_scaling != "linear":
            return 1.0
        per_update = self.effective_global_batch(num_workers) if self.mode == "sync" else self.batch_size
        return per_update / (self.base_batch_size or self.batch_size)

    def effective_global_batch(self, num_workers: int) -> int:
        """Samples per global step in sync mode."""
        return self.global_batch_size or self.batch_size * num_workers


def _check_codec(field_name: str, spec: object, *, allow_adaptive: bool) -> None:
    if not isinstance(spec, str) or not _COMPRESSION.fullmatch(spec):
        raise ConfigError(
            field_name,
            f"unknown codec {spec!r}; none|fp16|bf16|int8|qsgd:L|topk:R|powersgd:K|sign"
            + ("|adaptive" if allow_adaptive else ""),
        )
    if spec == "adaptive":
        if not allow_adaptive:
            raise ConfigError(field_name, "'adaptive' is only for `compression`")
        return
    # Checked here without importing torch (the coordinator validates experiments too); the
    # ranges are those of gossamer.compression.parse_codec.
    name, _, arg = spec.partition(":")
    if name == "qsgd" and not 1 <= int(arg) <= 127:
        raise ConfigError(field_name, f"{spec!r}: qsgd needs 1 <= L <= 127")
    if name == "powersgd" and int(arg) < 1:
        raise ConfigError(field_name, f"{spec!r}: powersgd needs rank K >= 1")
    if name == "topk" and not 0 < float(arg) <= 1:
        raise ConfigError(field_name, f"{spec!r}: topk needs 0 < R <= 1")


def _env_overrides() -> dict[str, Any]:
    out: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(Experiment)}
    for key, raw in os.environ.items():
        if not key.startswith("GOSSAMER_EXP_"):
            continue
        name = key[len("GOSSAMER_EXP_"):].lower()
        if name in fields:
            out[name] = _parse_scalar(raw)
    return out


def _parse_scalar(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def _not_number(v: object) -> bool:
    return isinstance(v, bool) or not isinstance(v, (int, float))


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _wire_problem(v: object, *, want_bool: bool = False, depth: int = 0) -> str | None:
    """Why `v` would not come back unchanged from JSON, TOML, SQLite or msgpack (None: it would).

    Top-level floats are left to their own range checks; inside tables and arrays
    (model_args, ...) a value must be plain JSON with finite numbers.
    """
    if want_bool:
        return None if isinstance(v, bool) else f"must be true or false, got a {type(v).__name__}"
    if v is None or isinstance(v, bool) or (isinstance(v, float) and depth == 0):
        return None
    if isinstance(v, int):
        return None if -_INT64 <= v < _INT64 else "must fit in 64 bits"
    if isinstance(v, float):
        return None if math.isfinite(v) else f"must hold finite numbers, got {v!r}"
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return "must be valid Unicode text (no lone surrogates)"
        return None
    if depth >= _MAX_DEPTH and isinstance(v, list | dict):
        return f"nests tables/arrays deeper than {_MAX_DEPTH} levels"
    if isinstance(v, list):
        return next((p for x in v if (p := _wire_problem(x, depth=depth + 1))), None)
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                return f"keys must be strings, got {k!r}"
            problem = _wire_problem(k, depth=depth + 1) or _wire_problem(x, depth=depth + 1)
            if problem:
                return problem
        return None
    if depth == 0:
        return None  # a wrong top-level type is named by the field's own check
    return f"must hold only JSON values (tables, arrays, strings, numbers, booleans), got {type(v).__name__}"
