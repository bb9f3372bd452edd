"""The Experiment's fields in sections: each field's section, one-line meaning and the modes it applies to."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gossamer.core.errors import ConfigError

__all__ = ["SECTIONS", "FieldDoc", "Section", "field_doc", "flatten", "nest", "section_of"]


@dataclass(frozen=True)
class FieldDoc:
    """One Experiment field: what it means and where it applies."""

    name: str
    #: One line for docs/experiment.md.
    help: str
    #: A boolean attribute of `gossamer.core.modes.Mode`: the field applies to the rows where it is
    #: true ("": to every mode); the mode table stays the one owner of what each mode does.
    modes: str = ""


@dataclass(frozen=True)
class Section:
    """A group of fields: a TOML table (`[optimizer]`) and a table of docs/experiment.md."""

    name: str
    summary: str
    fields: tuple[FieldDoc, ...]


#: Every Experiment field once, in the order docs/experiment.md lists them (tests hold the coverage).
SECTIONS: tuple[Section, ...] = (
    Section("run", "what runs, for how long and on how many workers", (
        FieldDoc("name", "the experiment's name, shown by status, events and metrics"),
        FieldDoc("mode", "how nodes train together: sync | async | gossip | diloco (docs/modes.md)"),
        FieldDoc("total_steps", "steps the run trains; the lr schedule and profiling count against it"),
        FieldDoc("seed", "seed of the model's initial weights and the data order"),
        FieldDoc("min_workers", "workers the run needs to start and to go on (fewer: it waits for nodes)"),
        FieldDoc("max_workers", "most workers the run takes"),
    )),
    Section("data", "what to train: the model, the data, the loss and the batch", (
        FieldDoc("workdir", '"sha256:<hex>" of the code directory `submit --workdir DIR` shipped (set by the '
                            "client): first on every role's sys.path (docs/experiments.md)"),
        FieldDoc("train", '"package.module:fn": your own loop, fn(ctx) on every worker rank; replaces '
                          "model, dataset, loss, collate and metrics"),
        FieldDoc("model", '"package.module:callable" returning the nn.Module, called with model_args'),
        FieldDoc("model_args", "keyword arguments of the model callable"),
        FieldDoc("dataset", '"package.module:callable" returning the (train, eval) pair of map-style, '
                            "iterable or Hugging Face datasets, called with dataset_args"),
        FieldDoc("dataset_args", "keyword arguments of the dataset callable"),
        FieldDoc("loss", 'cross_entropy | mse | model (the model returns it) | "package.module:callable" '
                         "called as fn(output, target)"),
        FieldDoc("collate", '"package.module:callable" making a batch of a list of samples ("": stack '
                            "pairs / default_collate)"),
        FieldDoc("num_workers", "DataLoader worker processes reading the training set (0: in the training "
                                "process)"),
        FieldDoc("prefetch", "batches read ahead of the step (0: none); with num_workers, per worker"),
        FieldDoc("batch_size", "samples per step on each worker node"),
        FieldDoc("global_batch_size", "samples per step over all workers, split over the current ones "
                                      "(unset: batch_size each); a train function's: per batch of ctx.data",
                 modes="allows_global_batch"),
    )),
    Section("optimizer", "the optimizer a step applies and its learning rate", (
        FieldDoc("optimizer", "sgd | adamw (or torch.optim.SGD | torch.optim.AdamW) | auto: the mode's default "
                              "(adamw for diloco's inner steps, sgd otherwise)"),
        FieldDoc("optimizer_args", "the optimizer's own arguments beyond the fields: AdamW's betas and eps, "
                                   "e.g. {betas = [0.9, 0.95]}"),
        FieldDoc("lr", "learning rate (diloco: of the inner steps)"),
        FieldDoc("lr_schedule", "constant | linear | cosine (decay to 0 at total_steps)"),
        FieldDoc("warmup_steps", "steps of linear warm-up to lr"),
        FieldDoc("momentum", "momentum of sgd (0: none; adamw has its own betas)"),
        FieldDoc("nesterov", "Nesterov momentum (sgd with momentum > 0)"),
        FieldDoc("weight_decay", "weight decay of the optimizer"),
        FieldDoc("max_grad_norm", "> 0: clip each node's gradient to this global L2 norm (0: no clipping)"),
        FieldDoc("lr_scaling", "none | linear: lr x (samples per update / base_batch_size)"),
        FieldDoc("base_batch_size", "the batch lr was tuned for (0: batch_size)"),
    )),
    Section("exchange", "how updates travel between workers and the parameter servers", (
        FieldDoc("num_ps_shards", "parameter-server shards holding the model (0 or ignored without "
                                  "servers)", modes="servers"),
        FieldDoc("ps_backup", "each shard has a backup on another node, which takes over when it fails",
                 modes="servers"),
        FieldDoc("chunk_numel", "most elements of the flat parameter vector in one chunk placed on a shard",
                 modes="servers"),
        FieldDoc("staleness", "SSP: a worker runs at most this many versions ahead of the slowest (unset: "
                              "no bound)", modes="staleness_applies"),
        FieldDoc("lr_staleness_scaling", "the shards scale an update's lr down by its staleness",
                 modes="staleness_applies"),
        FieldDoc("wait_for_stragglers", "SSP's bound waits for a worker under half the median pace too "
                                        "(false: its updates come in staler)", modes="staleness_applies"),
        FieldDoc("overlap", "exchange a step's update while the next step computes", modes="allows_overlap"),
    )),
    Section("compression", "the codecs of what nodes send each other (docs/compression.md)", (
        FieldDoc("compression", "codec of the updates pushed or gossiped | adaptive | auto: the mode's "
                                "default (int8 for diloco's pseudo-gradients, none otherwise)"),
        FieldDoc("compression_overrides", "parameter-name pattern -> codec, for the parameters it matches"),
        FieldDoc("pull_compression", "codec of the parameters a worker pulls from the shards",
                 modes="servers"),
        FieldDoc("error_feedback", "auto | on | off: the pushing worker keeps the residual its codec dropped "
                                   "(auto: on for int8, topk, randk, sign, powersgd)", modes="servers"),
        FieldDoc("adaptive_target_share", "compression = adaptive keeps transfer time under this share of "
                                          "compute", modes="servers"),
    )),
    Section("diloco", "DiLoCo's rounds: local steps, then an outer step", (
        FieldDoc("outer_step", "sync | async | gossip: how a round's pseudo-gradients combine",
                 modes="rounds"),
        FieldDoc("inner_steps", "local steps per round (H)", modes="rounds"),
        FieldDoc("outer_lr", "learning rate of the outer Nesterov step on the shards",
                 modes="outer_optimizer"),
        FieldDoc("outer_momentum", "momentum of the outer Nesterov step", modes="outer_optimizer"),
        FieldDoc("round_start", "where a worker keeps its round's starting parameters: memory (a copy) | "
                                "shards (pulled again at the round's end; a node of several ranks keeps a copy)", modes="holds_round_start"),
    )),
    Section("gossip", "the graph nodes average over", (
        FieldDoc("topology", "exponential | ring | random: who sends to whom each step", modes="gossips"),
        FieldDoc("gossip_lag", "a node does not begin a step while an in-neighbour is more than this many "
                               "steps behind (unset: never waits)", modes="lag_bounded"),
    )),
    Section("node", "inside a node: the layout over its local ranks and the precision (docs/intranode.md)", (
        FieldDoc("parallelism", "ddp | fsdp | pipeline over a node's local ranks (without servers: ddp)"),
        FieldDoc("pipeline_microbatches", "micro-batches a pipeline splits a batch into (divides "
                                          "batch_size)"),
        FieldDoc("pipeline_schedule", "gpipe | 1f1b"),
        FieldDoc("precision", "fp32 | bf16 (autocast, CPU and CUDA) | fp16 (autocast + loss scaling, CUDA)"),
    )),
    Section("evaluation", "what evaluation measures and how often", (
        FieldDoc("eval_every", "evaluate every this many steps"),
        FieldDoc("eval_samples", "evaluate on this many samples (0: the whole eval set; a stream's first "
                                 "10000)"),
        FieldDoc("metrics", '"package.module:callable": fn(model, eval_set) -> {name: float}, reported as '
                            "eval_<name>"),
    )),
    Section("checkpoint", "where and how often the run saves itself", (
        FieldDoc("checkpoint_every", "checkpoint every this many steps (0: none)"),
        FieldDoc("checkpoint_dir", 'where checkpoints go ("": the coordinator\'s default directory)'),
    )),
    Section("profile", "torch.profiler traces (docs/observability.md)", (
        FieldDoc("profile_steps", "> 0: a trace of this many steps on each profiled rank"),
        FieldDoc("profile_start", "each profiled rank's own step at which the trace starts"),
        FieldDoc("profile_nodes", "node names or ids to profile (empty: every worker)"),
    )),
    Section("deadlines", "how long the coordinator waits before it says or does something", (
        FieldDoc("start_timeout_s", "seconds STARTING may last: then it runs without the backups not yet "
                                    "synced, or fails naming what did not start"),
        FieldDoc("node_wait_timeout_s", "seconds a run left without nodes (a shard without host, or no "
                                        "worker) waits for them to return and resume it before it fails"),
        FieldDoc("progress_timeout_s", "seconds without a step reported before status and an event say "
                                       "the run makes no progress"),
        FieldDoc("shard_timeout_s", "seconds a worker waits for a shard's answer; then the worker is "
                                    "replaced and the timeout counts against the shard (two fail it over)"),
    )),
)

_SECTION_OF: dict[str, str] = {f.name: s.name for s in SECTIONS for f in s.fields}
_DOCS: dict[str, FieldDoc] = {f.name: f for s in SECTIONS for f in s.fields}
_NAMES = tuple(s.name for s in SECTIONS)


def section_of(field: str) -> str:
    """The section `field` belongs to (KeyError: a name no section lists)."""
    return _SECTION_OF[field]


def field_doc(field: str) -> FieldDoc:
    """`field`'s meaning and modes (KeyError: a name no section lists)."""
    return _DOCS[field]


def flatten(data: Mapping[Any, Any]) -> dict[Any, Any]:
    """Flat field names from flat keys, section tables (`{"optimizer": {"lr": 0.1}}`) and dotted keys
    (`"optimizer.lr"`), as a TOML file, `--set` or a client may give them.

    A key that names a section and holds a table is that section, even where a field has the section's
    name (`optimizer`, `compression`: those fields never hold a table). Other keys pass through as they
    are; the Experiment names the ones it does not know.

    Raises:
        ConfigError: naming a field in the wrong section or given twice, or the key (a section, a
            dotted key) that holds an unknown name or is neither a section nor a field.
    """
    out: dict[Any, Any] = {}
    given: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(key, str) and key in _NAMES and isinstance(value, Mapping):
            for name, v in value.items():
                _put(out, given, key, str(name), v, key)
        elif isinstance(key, str) and key.partition(".")[0] in _NAMES and "." in key:
            section, _, name = key.partition(".")
            _put(out, given, section, name, value, key)
        elif isinstance(key, str) and isinstance(value, Mapping) and key not in _SECTION_OF:
            close = difflib.get_close_matches(key, _NAMES, n=1, cutoff=0.6)
            raise ConfigError(key, "unknown section" + (f"; did you mean [{close[0]}]?" if close else
                                                        f"; the sections are {', '.join(_NAMES)}"))
        else:
            _put(out, given, "", key, value, key)
    return out


def _put(out: dict[Any, Any], given: dict[str, str], section: str, name: Any, value: Any, key: Any) -> None:
    """Record one field; `key` is what the user wrote (a section's name, a dotted key or the field)."""
    where = f"in [{section}]" if section else "as a flat key"
    if section:
        home = _SECTION_OF.get(name)
        if home is None:
            close = difflib.get_close_matches(name, [f.name for s in SECTIONS if s.name == section
                                                     for f in s.fields], n=1, cutoff=0.6)
            raise ConfigError(str(key), f"unknown field {name!r} in [{section}]"
                                        + (f"; did you mean {close[0]!r}?" if close else ""))
        if home != section:
            raise ConfigError(name, f"belongs in [{home}], not [{section}]")
    if name in out:
        raise ConfigError(str(name), f"given twice, {given[name]} and {where}")
    out[name] = value
    given[name] = where


def nest(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A flat {field: value} as {section: {field: value}} (the tables of a TOML file), in section order."""
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        table = {f.name: flat[f.name] for f in section.fields if f.name in flat}
        if table:
            out[section.name] = table
    return out
