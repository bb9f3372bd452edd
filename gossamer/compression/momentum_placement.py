"""Where the experiment's momentum runs: on the shards, or on the worker before a codec that needs it there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gossamer.core.codec_table import ADAPTIVE, codec_entry, parse_spec
from gossamer.core.modes import mode_of

if TYPE_CHECKING:
    from gossamer.core.experiment import Experiment

__all__ = ["density_warmup_steps", "momentum_on_worker", "sparse_on_worker"]


def _specs(exp: Experiment) -> list[str]:
    return [s for s in (exp.compression, *exp.compression_overrides.values()) if s != ADAPTIVE]


def momentum_on_worker(exp: Experiment) -> bool:
    """The worker applies `momentum` (and `nesterov`) before compressing, and the shards none.

    True in the modes whose shards apply the experiment's optimizer (sync, async) when the
    momentum is > 0 and any codec of the experiment (its `compression` or an override) is one
    whose registry entry says `worker_momentum` (sign, topk, randk). Then every parameter's
    momentum runs on the worker, so the shards hold none at all.
    """
    row = mode_of(exp)
    if not row.servers or row.outer_optimizer or exp.optimizer != "sgd" or exp.momentum == 0:
        return False
    return any(codec_entry(parse_spec(s.strip())[0].name).worker_momentum for s in _specs(exp))


def sparse_on_worker(exp: Experiment) -> bool:
    """`momentum_on_worker` with a sparse codec (topk, randk): DGC's masking and warm-up apply."""
    return momentum_on_worker(exp) and any(parse_spec(s.strip())[0].sparse for s in _specs(exp))


def density_warmup_steps(exp: Experiment) -> int:
    """Steps over which a sparse codec's density rises to its ratio: the run's `warmup_steps` (0: none).

    Only when asked: the warm-up sends denser updates, and a user who picks `topk:0.01` expects
    about 1% of the bytes (with DGC's warm-up over 5% of the run by default, digits' `topk:0.01`
    pushed 48.6x fewer bytes than `none` instead of the 50x it promises).
    """
    return exp.warmup_steps if sparse_on_worker(exp) else 0
