"""The settings of one parameter-server shard (`ShardConfig`), validated, and how an experiment sets them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gossamer.compression.momentum_placement import momentum_on_worker
from gossamer.core.errors import ConfigError
from gossamer.core.lr_schedule import LR_SCHEDULES
from gossamer.core.modes import BARRIER_CONSISTENCY, SHARD_CONSISTENCIES, mode_of
from gossamer.core.train_path import shards_step_optimizer
from gossamer.paramserver.optimizer import OptimizerConfig
from gossamer.transport.frames import FrameLimits
from gossamer.transport.outgoing import ReplyBudget
from gossamer.transport.ratelimit import RateLimit

if TYPE_CHECKING:
    from gossamer.core.experiment import Experiment

__all__ = ["ShardConfig"]

#: The versions of a shard whose rounds are not counted against `total_steps` (`ShardConfig.reduce`).
_UNBOUNDED = 1 << 62


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Settings of one shard server."""

    experiment: str
    shard: int
    #: The shard consistency (`gossamer.core.modes.SHARD_CONSISTENCIES`): "sync" or "async".
    mode: str
    staleness: int | None
    optimizer: OptimizerConfig
    total_steps: int
    lr_staleness_scaling: bool = False
    lr_schedule: str = "constant"  # applied by the primary on top of the staleness factor
    warmup_steps: int = 0
    staleness_in_rounds: bool = False  # diloco async: tau = versions since the basis / workers
    wait_for_stragglers: bool = False  # the SSP bound waits for a straggler too (`SSPGate`)
    expect_backup: bool = True  # False (ps_backup off): acks without a backup are not "unreplicated"
    #: Forward an update made of compressed pushes to the backup as those pushes (it decodes them),
    #: when that is the smaller message; False: always the dense fp32 gradient (the form before).
    replicate_encoded: bool = True
    worker_timeout_s: float = 30.0
    backup_timeout_s: float = 3.0
    checkpoint_every: int = 0
    #: Linear lr scaling (the experiment's `linear_lr_factor`, by the number of workers of
    #: an update); None: off.
    lr_linear: Callable[[int], float] | None = None
    #: A train function's sync (`gossamer.training.train_function`): each barrier round answers every worker with
    #: the mean of the round's gradients and holds the parameters the pushes carry beside them (each push is a
    #: chunk's gradient then its values, 2 x its size); the workers' own optimizer steps, the shard applies none.
    reduce: bool = False
    #: Size limits of everything received (ZMQ MAXMSGSIZE and decoding); None: derived from
    #: the shard's size (`FrameLimits.for_values`).
    limits: FrameLimits | None = None
    #: Per-peer message rate (None: unlimited); a peer over it gets ERROR "RATE_LIMITED".
    rate_limit: RateLimit | None = field(default_factory=RateLimit)
    #: Replies held for peers that have not read them: per connection, and bytes in all.
    reply_budget: ReplyBudget = field(default_factory=ReplyBudget)

    def __post_init__(self) -> None:
        if not isinstance(self.experiment, str) or not self.experiment:
            raise ConfigError("experiment", "must be a non-empty string")
        if not isinstance(self.shard, int) or self.shard < 0:
            raise ConfigError("shard", f"must be an int >= 0, got {self.shard!r}")
        if self.mode not in SHARD_CONSISTENCIES:
            raise ConfigError("mode", f"must be one of {SHARD_CONSISTENCIES}, got {self.mode!r}")
        if self.staleness is not None and (
            not isinstance(self.staleness, int)
            or isinstance(self.staleness, bool)
            or self.staleness < 0
        ):
            raise ConfigError("staleness", f"must be an int >= 0 or None, got {self.staleness!r}")
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError("optimizer", "must be an OptimizerConfig")
        if not isinstance(self.total_steps, int) or self.total_steps < 0:
            raise ConfigError("total_steps", f"must be an int >= 0, got {self.total_steps!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError("lr_schedule", f"must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not self.worker_timeout_s > 0:
            raise ConfigError("worker_timeout_s", f"must be > 0, got {self.worker_timeout_s!r}")
        if self.limits is not None and not isinstance(self.limits, FrameLimits):
            raise ConfigError("limits", "must be a FrameLimits or None")
        if self.rate_limit is not None and not isinstance(self.rate_limit, RateLimit):
            raise ConfigError("rate_limit", "must be a RateLimit or None")
        if not isinstance(self.reply_budget, ReplyBudget):
            raise ConfigError("reply_budget", "must be a ReplyBudget")
        if self.reduce and not self.barrier:
            raise ConfigError("reduce", "the mean of a round's gradients needs mode='sync' (a barrier)")

    @property
    def barrier(self) -> bool:
        """Every current worker's update is gathered before a version is applied (BSP)."""
        return self.mode == BARRIER_CONSISTENCY

    @classmethod
    def for_experiment(cls, exp: Experiment, experiment_id: str, shard: int) -> ShardConfig:
        """The settings a shard of `exp` runs with (from its row of the mode table).

        A mode with rounds (diloco): the shard is the outer loop. It receives pseudo-gradients
        (theta_0 - theta_H) once per round and applies the outer optimizer, Nesterov SGD with
        `outer_lr` and `outer_momentum`; a version is one outer round, so `total_steps` inner
        steps are ceil(total_steps / inner_steps) versions. The outer step is synchronous (a
        barrier over the current workers, like sync mode) or asynchronous (applied on arrival,
        the lr divided by the staleness in rounds: versions since the basis / workers, and
        Delayed Nesterov with `outer_momentum`, its momentum moved once per round of arrivals).
        """
        row = mode_of(exp)
        per_version = exp.inner_steps if row.rounds else 1
        # A train function's sync: a version is a round of gradients, one per backward pass the user makes (not
        # known here); the workers count the optimizer steps and end the run.
        # A user's train function steps its optimizer on the worker; gossamer's built-in loop pushes its gradients
        # for the experiment's optimizer here, through its train function too.
        on_worker = bool(exp.train) and not shards_step_optimizer(exp)
        reduce = on_worker and row.barrier and not row.rounds
        outer = row.outer_optimizer
        if outer:
            # Nesterov applied per arrival carries stale pseudo-gradients past the optimum
            # (digits, 4 workers, H=20: eval accuracy 0.63 with 0.6, 0.975 without): the
            # asynchronous outer step moves its momentum once per round (Delayed Nesterov).
            momentum = exp.outer_momentum
            optimizer = OptimizerConfig(name="sgd", lr=exp.outer_lr, momentum=momentum,
                                        nesterov=momentum > 0 and row.barrier,
                                        delayed=momentum > 0 and not row.barrier)
        elif on_worker:
            # A train function's optimizer steps on the worker, which pushes the change it made: the
            # shard adds each change as it comes (SGD, lr 1), so any optimizer keeps its meaning.
            optimizer = OptimizerConfig(name="sgd", lr=1.0)
        elif momentum_on_worker(exp):  # sign, topk, randk: the workers run it before compressing
            optimizer = OptimizerConfig(name=exp.optimizer, lr=exp.lr, weight_decay=exp.weight_decay,
                                        **exp.optimizer_settings())
        else:
            optimizer = OptimizerConfig(name=exp.optimizer, lr=exp.lr, momentum=exp.momentum,
                                        nesterov=exp.nesterov, weight_decay=exp.weight_decay,
                                        **exp.optimizer_settings())
        return cls(
            experiment=experiment_id, shard=shard, mode=row.shard_consistency,
            staleness=exp.staleness if row.staleness_applies else None, optimizer=optimizer,
            total_steps=_UNBOUNDED if reduce else -(-exp.total_steps // per_version), reduce=reduce,
            # Rounds: tau is the staleness in rounds (versions since the basis / workers).
            lr_staleness_scaling=row.rounds or (exp.lr_staleness_scaling and not on_worker),
            staleness_in_rounds=row.rounds,
            wait_for_stragglers=exp.wait_for_stragglers,
            # The outer optimizer has its own lr: no schedule, warmup or linear scaling.
            lr_schedule="constant" if outer or on_worker else exp.lr_schedule,
            warmup_steps=0 if outer or on_worker else exp.warmup_steps,
            lr_linear=exp.linear_lr_factor if not (outer or on_worker) and exp.lr_scaling != "none" else None,
            checkpoint_every=-(-exp.checkpoint_every // per_version), expect_backup=exp.ps_backup,
        )
