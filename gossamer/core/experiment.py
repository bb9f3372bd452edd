"""The Experiment: one validated, frozen description of a training run (TOML, CLI and RPC map onto it)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossamer.core.codec_table import ADAPTIVE, CODEC_NAMES, grammar, parse_spec
from gossamer.core.errors import ConfigError
from gossamer.core.experiment_sections import flatten
from gossamer.core.lr_schedule import LR_SCHEDULES
from gossamer.core.modes import MODES, OUTER_STEPS, TOPOLOGIES, Mode, mode_of, resolve
from gossamer.core.workdir import is_digest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OPTIMIZERS = ("sgd", "adamw")
#: torch's class names for them, accepted in `optimizer`.
OPTIMIZER_CLASSES = {"torch.optim.SGD": "sgd", "torch.optim.AdamW": "adamw"}
#: What `optimizer_args` may set for each (the rest are fields: lr, momentum, nesterov, weight_decay).
OPTIMIZER_ARGS: dict[str, tuple[str, ...]] = {"sgd": (), "adamw": ("betas", "eps")}
ERROR_FEEDBACK = ("auto", "on", "off")
ROUND_STARTS = ("memory", "shards")
#: Optimizers with a `momentum` (and `nesterov`); the others refuse it (paramserver/optimizer.py).
_MOMENTUM_OPTIMIZERS = ("sgd",)
PARALLELISMS = ("ddp", "fsdp", "pipeline")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")
#: Built-in losses (gossamer/engine/loss.py); a "package.module:callable" is the user's own.
LOSSES = ("cross_entropy", "mse", "model")
#: The fields that name user code, checked by importing them at submit (gossamer/core/import_check.py).
CODE_FIELDS = ("train", "model", "dataset", "loss", "collate", "metrics")
#: The modes a train function runs in (its optimizer steps on the worker; see training/train_function.py).
TRAIN_FUNCTION_MODES = ("sync", "async", "diloco", "gossip")
#: gossamer's own loop over `model`, `dataset`, `loss`, ... as a train function (core/train_path.py routes to it).
BUILTIN_TRAIN = "gossamer.training.builtin_train:train"
LR_SCALINGS = ("none", "linear")
_CALLABLE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
#: Integers travel through TOML, SQLite and msgpack: all three stop at 64 bits.
_INT64 = 1 << 63
_MAX_DEPTH = 32


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A training run. Every field has a default except `name`, and what to train: either `train`, the
    user's own loop (`"package.module:fn"`, called as `fn(ctx)` with a `gossamer.TrainContext` on every
    worker rank), or gossamer's loop over `model` and `dataset`.

    `model` and `dataset` are "module:callable" paths; the model callable returns an
    nn.Module (called with `model_args`), the dataset callable a (train, eval) pair of
    map-style datasets, torch IterableDatasets or `datasets.Dataset`s (called with
    `dataset_args`). `loss` is a built-in name or the user's `fn(output, target)`;
    `collate`, when set, makes a batch of a list of samples; `metrics` adds evaluation figures.
    `batch_size` is per worker node; in sync mode `global_batch_size`, when set, fixes the
    global batch and splits it over the current workers.
    """

    # Each field's section, meaning and modes: `experiment_sections.SECTIONS`, one entry per field
    # (docs/experiment.md is generated from it; a file may group the fields in section tables).
    name: str
    workdir: str = ""
    train: str = ""
    model: str = ""
    dataset: str = ""
    model_args: dict[str, Any] = field(default_factory=dict)
    dataset_args: dict[str, Any] = field(default_factory=dict)
    loss: str = "cross_entropy"
    collate: str = ""
    metrics: str = ""
    num_workers: int = 0
    prefetch: int = 0
    eval_samples: int = 0
    mode: str = "async"
    compression: str = "auto"
    compression_overrides: dict[str, str] = field(default_factory=dict)
    pull_compression: str = "none"
    error_feedback: str = "auto"
    adaptive_target_share: float = 0.2
    optimizer: str = "auto"
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.05
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    batch_size: int = 32
    global_batch_size: int | None = None
    staleness: int | None = None
    lr_staleness_scaling: bool = True
    #: SSP (`staleness`): a worker stepping at under half the others' median pace does not hold them back
    #: (its updates come in staler, the staleness-aware lr takes them down); True: the bound waits for it too.
    #: Gossip's `gossip_lag` always waits: there a node left behind ends with a model the others' disagree with.
    wait_for_stragglers: bool = False
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
    #: 0.6, not DiLoCo's 0.9 (arXiv:2311.08105, language models, 500-step rounds): with AdamW's inner steps each
    #: round moves every weight by about H x lr in a consistent direction, and 0.9 keeps ~10 rounds of them
    #: (a step up to 7x the round's mean), so the weights grow: digits, 3 workers, 400 steps, 12 seeds: parameter
    #: norm 48 against sync's 15, eval loss 0.59 against 0.10; 0.6 gives 20 and 0.10 (README, DiLoCo).
    outer_momentum: float = 0.6
    outer_step: str = "sync"
    round_start: str = "memory"
    topology: str = "exponential"
    #: 1, not None: a node that never waits for a straggler ends with a model the others agree
    #: with less (SGP's bounded delay; README, gossip).
    gossip_lag: int | None = 1
    parallelism: str = "ddp"
    pipeline_microbatches: int = 4
    pipeline_schedule: str = "gpipe"
    precision: str = "fp32"
    max_grad_norm: float = 0.0
    lr_scaling: str = "none"
    base_batch_size: int = 0
    chunk_numel: int = 1 << 20
    profile_steps: int = 0
    profile_start: int = 5
    profile_nodes: list[str] = field(default_factory=list)
    start_timeout_s: float = 600.0
    node_wait_timeout_s: float = 3600.0
    progress_timeout_s: float = 600.0
    shard_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        # In this order: each group may rely on the fields an earlier group checked.
        _check_wire(self)
        _check_identity(self)
        row = _resolve_mode(self)
        _check_codecs(self, row)
        _check_optimizer(self)
        _check_counts(self, row)
        _check_batching(self, row)
        _check_layout(self, row)
        _check_numerics(self)
        _check_outputs(self)
        _check_deadlines(self)

    # --- conversions -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Experiment:
        """Build from a plain dict (TOML table, JSON), flat or in section tables; unknown keys are an error naming them."""
        if not isinstance(data, dict):
            raise ConfigError("experiment", "must be an object/table")
        data = flatten(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), sorted(known), n=1, cutoff=0.6)
            raise ConfigError(str(unknown[0]), "unknown field" + (f"; did you mean {close[0]!r}?" if close else ""))
        if "name" not in data:
            raise ConfigError("name", "is required")
        if not data.get("train"):
            for required in ("model", "dataset"):
                if required not in data:
                    raise ConfigError(required, "is required (or name your own loop in 'train')")
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
        data = flatten(table)
        data.update(_env_overrides())
        data.update(flatten(overrides or {}))
        return cls.from_dict(data)

    # --- derived values ----------------------------------------------------------------
    def optimizer_settings(self) -> dict[str, Any]:
        """`optimizer_args` as OptimizerConfig takes them (betas as a tuple)."""
        out = dict(self.optimizer_args)
        if "betas" in out:
            out["betas"] = tuple(float(b) for b in out["betas"])
        return out

    def linear_lr_factor(self, num_workers: int = 1) -> float:
        """The linear scaling rule's lr multiplier: samples per update / `base_batch_size` (1 when off).

        An update is one worker's batch in async, gossip and diloco, and the global batch of
        `num_workers` workers in sync (Goyal et al. 2017; pair it with `warmup_steps`).
        """
        if self.lr_scaling != "linear":
            return 1.0
        # A mode whose step takes the global batch (sync) updates once per global batch.
        per_update = self.effective_global_batch(num_workers) if mode_of(self).allows_global_batch else self.batch_size
        return per_update / (self.base_batch_size or self.batch_size)

    def code_paths(self) -> dict[str, str]:
        """The user code this experiment names, by field ("loss" only when it is a callable path)."""
        paths = {f: getattr(self, f) for f in CODE_FIELDS}
        return {f: p for f, p in paths.items() if p and not (f == "loss" and p in LOSSES)}

    def effective_global_batch(self, num_workers: int) -> int:
        """Samples per global step in sync mode."""
        return self.global_batch_size or self.batch_size * num_workers


def _check_wire(exp: Experiment) -> None:
    # First, so no check below meets a value it cannot compare or convert.
    for fld in dataclasses.fields(exp):
        problem = _wire_problem(getattr(exp, fld.name), want_bool=fld.type == "bool")
        if problem:
            raise ConfigError(fld.name, problem)


def _check_train_function(exp: Experiment) -> None:
    """`train`: the user's loop owns the model, data, loss and metrics; gossamer owns the exchange."""
    if not isinstance(exp.train, str) or not _CALLABLE.fullmatch(exp.train):
        raise ConfigError("train", f"must look like 'package.module:fn', got {exp.train!r}")
    given = [f for f, default in (("model", ""), ("dataset", ""), ("loss", "cross_entropy"), ("collate", ""),
                                  ("metrics", "")) if getattr(exp, f) != default]
    if given and exp.train != BUILTIN_TRAIN:  # gossamer's own train function reads them
        raise ConfigError(given[0], f"the train function {exp.train!r} builds its own model, data, loss and "
                                    f"metrics; leave out {', '.join(given)}")
    if exp.mode not in TRAIN_FUNCTION_MODES:
        raise ConfigError("mode", f"a train function runs in {', '.join(TRAIN_FUNCTION_MODES)}; "
                                  f"mode {exp.mode!r} is not one of them")
    if exp.mode == "sync" and exp.train != BUILTIN_TRAIN:  # gossamer's own: the shards step on the gradients
        # Every worker steps its optimizer on the round's mean gradient: exact, or the workers drift apart.
        for f in ("compression", "pull_compression"):
            if getattr(exp, f) not in ("auto", "none"):
                raise ConfigError(f, f"a train function's sync exchanges exact gradients; got {getattr(exp, f)!r}")
    if exp.parallelism != "ddp":
        raise ConfigError("parallelism", "a train function runs with parallelism='ddp' (every local rank holds "
                                         "the whole model)")


def _check_identity(exp: Experiment) -> None:
    """`name`, and what to train: `model`, `dataset` and their arguments."""
    if not isinstance(exp.name, str) or not exp.name.strip():
        raise ConfigError("name", "must be a non-empty string")
    if not isinstance(exp.workdir, str) or (exp.workdir and not is_digest(exp.workdir)):
        raise ConfigError("workdir", f"must be the 'sha256:<64 hex>' of code shipped with `submit --workdir DIR` "
                                     f"(or empty), got {exp.workdir!r}")
    if not isinstance(exp.train, str):
        raise ConfigError("train", f"must be a string 'package.module:fn' (or empty), got {type(exp.train).__name__}")
    if exp.train:
        _check_train_function(exp)
        if exp.train != BUILTIN_TRAIN:
            return
    for f in ("model", "dataset"):
        v = getattr(exp, f)
        if not isinstance(v, str) or not _CALLABLE.fullmatch(v):
            raise ConfigError(f, f"must look like 'package.module:callable', got {v!r}")
    for f in ("model_args", "dataset_args"):
        if not isinstance(getattr(exp, f), dict):
            raise ConfigError(f, "must be a table/dict")
    if not isinstance(exp.loss, str) or (exp.loss not in LOSSES and not _CALLABLE.fullmatch(exp.loss)):
        raise ConfigError("loss", f"unknown loss {exp.loss!r}; choose {', '.join(LOSSES)} or your own "
                                  "'package.module:callable' (called as fn(output, target) -> batch-mean loss)")
    for f in ("collate", "metrics"):
        v = getattr(exp, f)
        if not isinstance(v, str) or (v and not _CALLABLE.fullmatch(v)):
            raise ConfigError(f, f"must be empty or look like 'package.module:callable', got {v!r}")
    for f in ("num_workers", "prefetch", "eval_samples"):
        v = getattr(exp, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f, f"must be an integer >= 0, got {v!r}")


def _resolve_mode(exp: Experiment) -> Mode:
    """Check `mode` and `outer_step`, resolve the mode's defaults, and return its table row."""
    if exp.mode not in MODES:
        raise ConfigError("mode", f"unknown mode {exp.mode!r}; choose one of {', '.join(MODES)}")
    if exp.outer_step not in OUTER_STEPS:
        raise ConfigError("outer_step", f"unknown outer step {exp.outer_step!r}; choose {', '.join(OUTER_STEPS)}")
    row = mode_of(exp)
    # Mode-dependent defaults are resolved here, so every copy (TOML, JSON, RPC) agrees.
    if exp.compression == "auto":
        object.__setattr__(exp, "compression", row.default_compression)
    if exp.optimizer == "auto":
        object.__setattr__(exp, "optimizer", row.default_optimizer)
    return row


def _check_codecs(exp: Experiment, row: Mode) -> None:
    """`compression`, `pull_compression`, `compression_overrides` (the registry's grammar), `error_feedback`,
    and `round_start` (which needs full values pulled)."""
    _check_codec("compression", exp.compression, allow_adaptive=True)
    _check_codec("pull_compression", exp.pull_compression, allow_adaptive=False)
    if not isinstance(exp.compression_overrides, dict):
        raise ConfigError("compression_overrides", "must map a parameter-name pattern to a codec")
    for pattern, spec in exp.compression_overrides.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError("compression_overrides", f"pattern {pattern!r} must be a non-empty string")
        _check_codec("compression_overrides", spec, allow_adaptive=False)
    if exp.error_feedback not in ERROR_FEEDBACK:
        raise ConfigError("error_feedback", f"must be one of {', '.join(ERROR_FEEDBACK)}, got {exp.error_feedback!r}")
    if exp.error_feedback != "auto" and not row.servers:
        raise ConfigError("error_feedback", f"{row.label} pushes no gradients to servers; leave it 'auto'")
    if exp.round_start not in ROUND_STARTS:
        raise ConfigError("round_start", f"must be one of {', '.join(ROUND_STARTS)}, got {exp.round_start!r}")
    if exp.round_start == "shards" and (row.name != "diloco" or not row.barrier or exp.pull_compression != "none"):
        raise ConfigError("round_start", "'shards' needs mode 'diloco' with outer_step 'sync' (the shards hold the "
                                         "round's start until its barrier) and pull_compression 'none' (the values "
                                         f"pulled are the ones trained from); got {row.label}, pull_compression "
                                         f"{exp.pull_compression!r}")
    if _not_number(exp.adaptive_target_share) or not 0 < exp.adaptive_target_share <= 10:
        raise ConfigError("adaptive_target_share", f"must be in (0, 10], got {exp.adaptive_target_share!r}")
    if row.exchanges_values:
        for f, spec in [("compression", exp.compression), ("pull_compression", exp.pull_compression),
                        *(("compression_overrides", v) for v in exp.compression_overrides.values())]:
            if spec == ADAPTIVE or not parse_spec(spec, field=f)[0].carries_values:
                raise ConfigError(f, f"{row.label} exchanges parameter values, so {spec!r} does not apply; use "
                                     f"{grammar(values_only=True)} (sparse/sign codecs need a shared reference)")


def _check_optimizer(exp: Experiment) -> None:
    """`optimizer` and its settings, refusing what the roles' OptimizerConfig would refuse."""
    if isinstance(exp.optimizer, str) and exp.optimizer in OPTIMIZER_CLASSES:
        object.__setattr__(exp, "optimizer", OPTIMIZER_CLASSES[exp.optimizer])
    if exp.optimizer not in OPTIMIZERS:
        if isinstance(exp.optimizer, str) and ("." in exp.optimizer or ":" in exp.optimizer):
            raise ConfigError("optimizer", f"gossamer's own loop runs {' or '.join(sorted(OPTIMIZER_CLASSES))} on its "
                                           f"shards, not {exp.optimizer!r}; to train with any optimizer, write your "
                                           "loop as a train function (Experiment(train='package.module:fn'))")
        raise ConfigError("optimizer", f"unknown optimizer {exp.optimizer!r}; choose {', '.join(OPTIMIZERS)} "
                                       f"(or {', '.join(sorted(OPTIMIZER_CLASSES))})")
    _check_optimizer_args(exp)
    for f in ("lr", "outer_lr"):
        v = getattr(exp, f)
        if _not_number(v) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f, f"must be a finite number > 0, got {v!r}")
    for f in ("momentum", "outer_momentum", "weight_decay"):
        v = getattr(exp, f)
        if _not_number(v) or not math.isfinite(v) or v < 0 or (f != "weight_decay" and v >= 1):
            raise ConfigError(f, f"must be in [0, 1), got {v!r}")
    if exp.nesterov and exp.momentum == 0:
        raise ConfigError("nesterov", "needs momentum > 0")
    # Every mode builds an OptimizerConfig of these fields (the shards' optimizer, or the
    # workers' inner one), which refuses them at each role's start: refuse them at submit.
    if exp.optimizer not in _MOMENTUM_OPTIMIZERS:
        if exp.nesterov:
            raise ConfigError("nesterov", f"only applies to optimizer='sgd', got optimizer={exp.optimizer!r}")
        if exp.momentum:
            raise ConfigError("momentum", f"only applies to optimizer='sgd' ({exp.optimizer} has its own betas); "
                                          "leave momentum at 0")


def _check_optimizer_args(exp: Experiment) -> None:
    """`optimizer_args`: the optimizer's own arguments beyond the fields (AdamW's betas and eps)."""
    args = exp.optimizer_args
    if not isinstance(args, dict):
        raise ConfigError("optimizer_args", "must be a table/dict, e.g. {betas = [0.9, 0.95]}")
    allowed = OPTIMIZER_ARGS[exp.optimizer]
    for key, value in args.items():
        if key in ("lr", "momentum", "weight_decay", "nesterov"):
            raise ConfigError("optimizer_args", f"{key!r} is a field of its own: set {key} = {value!r}")
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" ({', '.join(allowed) or 'none'} are)"
            raise ConfigError("optimizer_args", f"{key!r} is not an argument of {exp.optimizer} here{hint}")
    betas = args.get("betas", (0.9, 0.999))
    if (not isinstance(betas, tuple | list) or len(betas) != 2
            or any(_not_number(b) or not 0 <= b < 1 for b in betas)):
        raise ConfigError("optimizer_args", f"betas must be two numbers in [0, 1), got {betas!r}")
    eps = args.get("eps", 1e-8)
    if _not_number(eps) or not math.isfinite(eps) or eps <= 0:
        raise ConfigError("optimizer_args", f"eps must be a finite number > 0, got {eps!r}")


def _check_counts(exp: Experiment, row: Mode) -> None:
    """Integer sizes and counts: batch, shards, workers, steps, chunk size."""
    serverless_zero = not row.servers and type(exp.num_ps_shards) is int and exp.num_ps_shards == 0
    for f in ("batch_size", *(() if serverless_zero else ("num_ps_shards",)), "min_workers", "max_workers", "total_steps",
              "inner_steps", "chunk_numel"):
        if not _positive_int(getattr(exp, f)):
            more = "" if f != "num_ps_shards" or row.servers else f" (or 0: {row.label} runs without servers)"
            raise ConfigError(f, f"must be an integer >= 1{more}, got {getattr(exp, f)!r}")
    if exp.lr_schedule not in LR_SCHEDULES:
        raise ConfigError("lr_schedule", f"unknown lr schedule {exp.lr_schedule!r}; choose {', '.join(LR_SCHEDULES)}")
    for f in ("eval_every", "checkpoint_every", "seed", "warmup_steps"):
        v = getattr(exp, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f, f"must be an integer >= 0, got {v!r}")
    if not isinstance(exp.ps_backup, bool):
        raise ConfigError("ps_backup", f"must be true or false, got {exp.ps_backup!r}")
    if exp.warmup_steps >= exp.total_steps:
        raise ConfigError("warmup_steps", f"must be < total_steps ({exp.total_steps}), got {exp.warmup_steps}")
    if exp.max_workers < exp.min_workers:
        raise ConfigError("max_workers", f"must be >= min_workers ({exp.min_workers})")


def _check_batching(exp: Experiment, row: Mode) -> None:
    """`global_batch_size`, `staleness` and `overlap`, each where the mode uses it."""
    if exp.global_batch_size is not None:
        if not _positive_int(exp.global_batch_size):
            raise ConfigError("global_batch_size", "must be an integer >= 1 or unset")
        if not row.allows_global_batch:
            raise ConfigError("global_batch_size", f"only applies to {_modes_where(lambda m: m.allows_global_batch)}")
        if exp.global_batch_size < exp.min_workers:
            raise ConfigError("global_batch_size", "must be >= min_workers (one sample per worker)")
    if exp.staleness is not None and (
        not isinstance(exp.staleness, int) or isinstance(exp.staleness, bool) or exp.staleness < 0
    ):
        raise ConfigError("staleness", f"must be an integer >= 0 or None, got {exp.staleness!r}")
    if exp.overlap and not row.allows_overlap:
        raise ConfigError("overlap", f"only applies to {_modes_where(lambda m: m.allows_overlap)} (the others "
                                     "wait for every worker each step, or exchange once per round)")


def _check_layout(exp: Experiment, row: Mode) -> None:
    """`topology` and the layout inside a node: `parallelism` and the pipeline's settings."""
    if exp.topology not in TOPOLOGIES:
        raise ConfigError("topology", f"unknown topology {exp.topology!r}; choose {', '.join(TOPOLOGIES)}")
    if exp.gossip_lag is not None and (
        not isinstance(exp.gossip_lag, int) or isinstance(exp.gossip_lag, bool) or exp.gossip_lag < 0
    ):
        raise ConfigError("gossip_lag", f"must be an integer >= 0 or None, got {exp.gossip_lag!r}")
    if exp.gossip_lag != 1 and (row.servers or row.rounds):
        raise ConfigError("gossip_lag", f"only applies to mode gossip ({row.label} "
                                        f"{'has parameter servers' if row.servers else 'mixes once per round'})")
    if exp.parallelism not in PARALLELISMS:
        raise ConfigError("parallelism", f"unknown parallelism {exp.parallelism!r}; choose {', '.join(PARALLELISMS)}")
    if exp.parallelism not in row.parallelisms:
        raise ConfigError("parallelism", f"{exp.parallelism} runs with the parameter servers (each rank exchanges "
                                         f"its own part with the shards), and {row.label} has none: it mixes a whole "
                                         f"replica on every local rank (use parallelism={'|'.join(row.parallelisms)})")
    if exp.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError("pipeline_schedule", f"unknown schedule {exp.pipeline_schedule!r}; choose "
                                               f"{', '.join(PIPELINE_SCHEDULES)}")
    if not _positive_int(exp.pipeline_microbatches):
        raise ConfigError("pipeline_microbatches", f"must be an integer >= 1, got {exp.pipeline_microbatches!r}")
    if exp.parallelism == "pipeline":
        if exp.batch_size % exp.pipeline_microbatches:
            raise ConfigError("pipeline_microbatches", f"must divide batch_size ({exp.batch_size}), "
                                                       f"got {exp.pipeline_microbatches}")
        if exp.global_batch_size is not None:
            raise ConfigError("global_batch_size", "pipeline keeps batch_size per worker; leave global_batch_size unset")
        if exp.loss == "model":
            raise ConfigError("loss", "pipeline computes the loss on its last stage from (input, target) micro-batches; "
                                      "loss='model' needs the whole model and batch on one rank (use ddp or fsdp)")


def _check_numerics(exp: Experiment) -> None:
    """`precision`, gradient clipping and lr scaling."""
    if exp.precision not in PRECISIONS:
        raise ConfigError("precision", f"unknown precision {exp.precision!r}; choose {', '.join(PRECISIONS)}")
    if _not_number(exp.max_grad_norm) or not math.isfinite(exp.max_grad_norm) or exp.max_grad_norm < 0:
        raise ConfigError("max_grad_norm", f"must be a finite number >= 0 (0: no clipping), got {exp.max_grad_norm!r}")
    if exp.lr_scaling not in LR_SCALINGS:
        raise ConfigError("lr_scaling", f"unknown lr scaling {exp.lr_scaling!r}; choose {', '.join(LR_SCALINGS)}")
    if not isinstance(exp.base_batch_size, int) or isinstance(exp.base_batch_size, bool) or exp.base_batch_size < 0:
        raise ConfigError("base_batch_size", f"must be an integer >= 0 (0: batch_size), got {exp.base_batch_size!r}")


def _check_outputs(exp: Experiment) -> None:
    """What a run writes besides metrics: checkpoints and profiler traces."""
    if not isinstance(exp.checkpoint_dir, str):
        raise ConfigError("checkpoint_dir", "must be a path string")
    for f in ("profile_steps", "profile_start"):
        v = getattr(exp, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f, f"must be an integer >= 0, got {v!r}")
    if not isinstance(exp.profile_nodes, list) or not all(isinstance(n, str) and n for n in exp.profile_nodes):
        raise ConfigError("profile_nodes", "must be a list of node names or ids (empty: every worker)")
    if exp.profile_nodes and not exp.profile_steps:
        raise ConfigError("profile_nodes", "needs profile_steps > 0")
    if exp.profile_steps and exp.profile_start + exp.profile_steps > exp.total_steps:
        raise ConfigError("profile_steps", f"profile_start + profile_steps must be <= total_steps ({exp.total_steps})")


def _check_deadlines(exp: Experiment) -> None:
    """How long the coordinator waits on a start, on lost nodes and on progress before it says or does something."""
    for f in ("start_timeout_s", "node_wait_timeout_s", "progress_timeout_s", "shard_timeout_s"):
        v = getattr(exp, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 1 <= v <= 30 * 86400:
            raise ConfigError(f, f"must be a number of seconds in 1..{30 * 86400} (30 days), got {v!r}")


def _check_codec(field_name: str, spec: object, *, allow_adaptive: bool) -> None:
    # Checked by the registry's grammar, without importing torch (the coordinator validates
    # experiments too); workers and shards parse the same grammar (`parse_codec`).
    if spec == ADAPTIVE:
        if not allow_adaptive:
            raise ConfigError(field_name, "'adaptive' is only for `compression`")
        return
    if not isinstance(spec, str) or spec.partition(":")[0] not in CODEC_NAMES:
        raise ConfigError(field_name, f"unknown codec {spec!r}; {grammar()}" + (f"|{ADAPTIVE}" if allow_adaptive else ""))
    parse_spec(spec, field=field_name)


def _modes_where(pred: Callable[[Mode], bool]) -> str:
    """ "mode='async' or mode='gossip'": the rows of the mode table that satisfy `pred`."""
    rows = {resolve(m, o).label: resolve(m, o) for m in MODES for o in OUTER_STEPS}
    return " or ".join(
        f"mode={r.name!r}" + (f" with outer_step={r.outer_step!r}" if r.outer_step else "")
        for r in rows.values() if pred(r)
    )


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
