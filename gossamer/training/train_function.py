"""`Experiment(train="pkg.mod:fn")`: the user's own loop, gossamer's exchange in its optimizer step (sync: backward)."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from gossamer.core.errors import ConfigError, GossamerError, ShardError
from gossamer.core.experiment import Experiment
from gossamer.core.faults import die_at, gate_at, hold_at
from gossamer.core.import_check import resolve
from gossamer.core.modes import mode_of
from gossamer.core.protocol import AssignmentUpdate
from gossamer.core.train_path import shards_step_optimizer
from gossamer.engine import sampler
from gossamer.engine.profiling import StepProfiler
from gossamer.engine.rank import Hook, RankContext, StepAbandoned, StepStats
from gossamer.paramserver import PullResult
from gossamer.training.gossip_loop import GossipTrainer
from gossamer.training.ps_trainer import ParameterServerTrainer
from gossamer.training.rank_trainer import OnSaved
from gossamer.transport.router import FAILED_PRECONDITION, REFORM

log = logging.getLogger(__name__)

__all__ = ["GossamerOptimizer", "ShardStepped", "StepRedo", "TrainContext", "capture_model", "run_local"]


class StepRedo(Exception):  # noqa: N818 - control flow between the sync trainer and gossamer's own loop
    """sync: the barrier re-formed during this step's exchange, or the shards moved on; its samples are now the
    new workers' shares, so gossamer's own loop computes the step again (out of `optimizer.step()`, as the older
    trainer does). A user's loop sends the same gradient again."""


class _Runtime:
    """What a `TrainContext` asks of the run: the exchange, the progress, the membership. This base is
    one plain process (`run_local`): the optimizer steps alone and the run ends at `total_steps`."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.steps = 0
        #: sync: backward exchanges the gradients (False inside `TrainContext.no_sync`).
        self.sync_grads = True
        #: How the train function evaluates the model, where it gave one (`TrainContext.evaluate_with`).
        self.evaluator: Callable[[], dict[str, float]] | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def count(self, samples: int) -> None:
        """`samples` more trained on (status' rate)."""

    def evaluate_with(self, fn: Callable[[], dict[str, float]]) -> None:
        self.evaluator = fn

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def worker_index(self) -> int:
        return 0

    @property
    def is_lead(self) -> bool:
        return True

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make `model` the run's (its current state); called once."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step and the mode's exchange."""
        optimizer.step()
        self.steps += 1

    def done(self) -> bool:
        return self.steps >= self.exp.total_steps

    def stopping(self) -> bool:
        return False

    def report(self, values: dict[str, float]) -> None:
        log.info("step %d: %s", self.steps, " ".join(f"{k} {v:.4g}" for k, v in sorted(values.items())))


class _Captured(Exception):  # noqa: N818 - control flow, never seen by the user
    def __init__(self, model: nn.Module) -> None:
        super().__init__("captured")
        self.model = model


class _Capture(_Runtime):
    """A shard host runs the train function up to `prepare` to build the model the workers will train."""

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise _Captured(model)


class GossamerOptimizer(torch.optim.Optimizer):
    """The user's optimizer, whose `step()` also does the mode's exchange.

    It shares the user's `param_groups`, `state` and `defaults` (LR schedulers, `clip_grad_norm_` and
    `transformers.Trainer` see the user's), so it is a `torch.optim.Optimizer` wherever one is expected.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: _Runtime) -> None:  # noqa: D107
        # Not Optimizer.__init__: the user's optimizer already holds the groups and the state.
        self.optimizer = optimizer
        self._runtime = runtime
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        self._stepping = False
        self._shapes = [(p, p.shape) for g in optimizer.param_groups for p in g["params"]]
        # Stepping the user's own optimizer would change this worker's model and exchange nothing.
        optimizer.register_step_pre_hook(self._only_through_gossamer)

    def _only_through_gossamer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._stepping:
            raise ConfigError("train", "the optimizer passed to ctx.prepare was stepped directly; call step() on the "
                                       "one ctx.prepare returned (model, optimizer = ctx.prepare(model, optimizer))")

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("train", "a closure in optimizer.step(closure) is not supported by gossamer's "
                                       "exchange; compute the loss and call step()")
        changed = [tuple(p.shape) for p, shape in self._shapes if p.shape != shape]
        if changed:
            raise ConfigError("train", f"a parameter changed shape after ctx.prepare (now {changed[0]}); the run's "
                                       "parameters keep the shapes the model had when it was prepared")
        self._stepping = True
        try:
            self._runtime.step(self.optimizer)
        finally:
            self._stepping = False
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"GossamerOptimizer({self.optimizer!r})"


class ShardStepped(torch.optim.Optimizer):
    """What gossamer's built-in loop prepares in async and sync: the experiment's optimizer runs on the shards, on
    the gradient each step pushes (`shards_step_optimizer`), so nothing steps here and no state is kept here.

    Built without `Optimizer.__init__`, which imports torch's dynamo (about a second a process): the one group
    is what LR code and `clip_grad_norm_` read.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:  # noqa: D107
        self.defaults = {"lr": 0.0}
        self.param_groups = [{"params": list(params), "lr": 0.0}]
        self.state = collections.defaultdict(dict)
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        raise ConfigError("train", "ShardStepped steps on the shards: it is gossamer's built-in loop's")


class TrainContext:
    """What a train function gets: its worker's place in the run, the run's state and its share of the data.

    `model, optimizer = ctx.prepare(model, optimizer)` starts the model from where the run is and
    returns the optimizer whose `step()` exchanges (in sync `backward()` does, `ctx.no_sync()` skips it);
    `ctx.data(dataset, batch_size=B)` yields this worker's batches until the run ends; `ctx.report(loss=...)`
    feeds status, watch and plot.
    """

    def __init__(self, runtime: _Runtime) -> None:  # noqa: D107
        self._runtime = runtime
        self._optimizer: GossamerOptimizer | None = None

    @property
    def experiment(self) -> Experiment:
        return self._runtime.exp

    @property
    def rank(self) -> int:
        """This worker's rank among the current workers (changes as workers join and leave)."""
        return self._runtime.rank

    @property
    def world_size(self) -> int:
        """The number of workers now."""
        return self._runtime.world_size

    @property
    def worker_index(self) -> int:
        """This worker's index in the run: unlike `rank`, kept while others join and leave (its own sample stream)."""
        return self._runtime.worker_index

    @property
    def is_lead(self) -> bool:
        """The worker that evaluates and writes the final checkpoint."""
        return self._runtime.is_lead

    @property
    def step(self) -> int:
        """The run's progress in optimizer steps, as compared with `total_steps`."""
        return self._runtime.steps

    @property
    def device(self) -> torch.device:
        """Where this worker trains: its GPU where the node has one (`ctx.prepare` moves the model there)."""
        return self._runtime.device

    def count(self, samples: int) -> None:
        """`samples` more trained on, for the run's samples and rate (`ctx.data` counts the batches it yields)."""
        self._runtime.count(samples)

    def evaluate_with(self, fn: Callable[[], dict[str, float]]) -> None:
        """gossamer evaluates the run's model with `fn()` (`{"accuracy": ...}`, reported as eval_* figures).

        The lead calls it every `eval_every` steps and once the run has ended, on the run's parameters: at
        the end those it checkpoints (async and diloco: pulled from the shards after the train function
        returned), and in gossip the peers' push-sum average. The final figures are the run's result.
        """
        self._runtime.evaluate_with(fn)

    def should_stop(self) -> bool:
        """The run is over, cancelled, or this node was told to leave: end the loop."""
        return self._runtime.done() or self._runtime.stopping()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """sync: the backward passes inside keep their gradients to this worker (torch DDP's `no_sync`).

        In sync mode every `backward()` exchanges the gradients accumulated so far and leaves the workers' mean
        in each `.grad`; with gradient accumulation, put the backward passes of all micro-batches but the last
        inside `no_sync()`: one exchange per optimizer step, with the same result. Other modes exchange in
        `optimizer.step()`, and this does nothing.
        """
        before, self._runtime.sync_grads = self._runtime.sync_grads, False
        try:
            yield
        finally:
            self._runtime.sync_grads = before

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, GossamerOptimizer]:
        """Load the run's current state into `model`; the returned optimizer's `step()` exchanges."""
        if self._optimizer is not None:
            raise ConfigError("train", "ctx.prepare was called twice; call it once with the model and optimizer")
        if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError("train", "ctx.prepare(model, optimizer) takes an nn.Module and a torch.optim.Optimizer, "
                                       f"got {type(model).__name__} and {type(optimizer).__name__}")
        params = {id(p) for p in model.parameters()}
        stray = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in params)
        if stray:
            raise ConfigError("train", f"the optimizer holds {stray} tensor(s) that are not the model's parameters")
        self._runtime.prepare(model, optimizer)
        self._optimizer = GossamerOptimizer(optimizer, self._runtime)
        return model, self._optimizer

    def data(self, dataset: Any, batch_size: int | None = None, collate_fn: Callable[[list[Any]], Any] | None = None,
             shuffle: bool = True) -> Iterator[Any]:
        """This worker's batches of `dataset` (map-style, `IterableDataset` or a Hugging Face dataset).

        A map-style set is sampled deterministically from the experiment's seed, an independent
        stream per worker; an iterable one is dealt out by the current rank. Ends when the run is done,
        cancelled, or this node leaves.

        sync with `global_batch_size` G: the run's i-th batch is the same G samples whatever the number of
        workers (drawn from the seed, or the stream's next G), and each worker gets its rank's share of them
        (G / workers, the first ones one more where G does not divide): N workers' mean gradient is one
        process's over G samples. `batch_size`, if given, must then be G.
        """
        size = batch_size or self.experiment.batch_size
        if size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {size}")
        split = self._global_batch(batch_size)
        size = split or size
        collate = collate_fn or default_collate
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
            yield from self._stream(dataset, size, collate, split=bool(split))
            return
        n = len(dataset)
        if n == 0:
            raise ConfigError("dataset", "the dataset passed to ctx.data is empty")
        batch = self.step  # a worker joining mid-run does not replay its predecessor's batches
        while not self.should_stop():
            if split:
                picked = (sampler.sync_global_batch(n, size, batch, self.experiment.seed) if shuffle
                          else torch.tensor([(batch * size + i) % n for i in range(size)]))
                idx = sampler.even_split(picked, self.world_size, self.rank).tolist()
            elif shuffle:
                idx = sampler.async_batch(n, size, batch, self.experiment.seed, self.worker_index).tolist()
            else:
                start = (batch * self.world_size + self.rank) * size
                idx = [(start + i) % n for i in range(min(size, n))]
            self.count(len(idx))
            yield collate([dataset[i] for i in idx])
            batch += 1

    def _global_batch(self, batch_size: int | None) -> int:
        """The samples of one batch over all workers (sync with `global_batch_size`), else 0."""
        exp = self.experiment
        if exp.mode != "sync" or not exp.global_batch_size:
            return 0
        if batch_size is not None and batch_size != exp.global_batch_size:
            raise ConfigError("batch_size", f"ctx.data(batch_size={batch_size}) with global_batch_size "
                                            f"{exp.global_batch_size}: in sync each batch is this worker's share of "
                                            "the global batch; leave batch_size out or pass global_batch_size")
        return exp.global_batch_size

    def _stream(self, dataset: Any, size: int, collate: Callable[[list[Any]], Any], *,
                split: bool = False) -> Iterator[Any]:
        """Dealt out by position; `split`: each `size` items in a row are a global batch, cut among the workers."""
        items: list[Any] = []
        for position, item in enumerate(dataset):
            if self.should_stop():
                return
            if not split and position % self.world_size != self.rank:
                continue
            items.append(item)
            if len(items) == size:
                mine = sampler.even_split(items, self.world_size, self.rank) if split else items
                self.count(len(mine))
                yield collate(mine)
                items = []

    def report(self, **values: float) -> None:
        """Figures of this step (`loss=...`; `eval_*` keys are evaluations), into status, watch, plot and /metrics."""
        clean: dict[str, float] = {}
        for k, v in values.items():
            try:
                clean[k] = float(v)
            except (TypeError, ValueError):
                raise ConfigError("report", f"{k}={v!r} is not a number") from None
        self._runtime.report(clean)


def _call(exp: Experiment, runtime: _Runtime) -> None:
    fn = resolve(exp.train)
    if not callable(fn):
        raise ConfigError("train", f"{exp.train!r} is not callable")
    torch.manual_seed(exp.seed)  # every process builds the same initial model
    try:
        fn(TrainContext(runtime))
    except (GossamerError, StepAbandoned, _Captured):
        raise
    except Exception as e:  # the user's code failed: say where, and name the field, so the run gives up on it
        raise ConfigError("train", f"{exp.train} raised {_summary(e)}") from e


def _summary(e: BaseException) -> str:
    """`ValueError: boom (at mymodule.py:12 in train)`: the exception and the user's innermost frame."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [f for f in frames if "/gossamer/" not in f.filename.replace("\\", "/")] or frames
    where = f" (at {Path(user[-1].filename).name}:{user[-1].lineno} in {user[-1].name})" if user else ""
    return f"{type(e).__name__}: {e}{where}"


def capture_model(exp: Experiment) -> nn.Module:
    """The model the train function builds and hands to `ctx.prepare` (run up to there, on a shard host)."""
    try:
        _call(exp, _Capture(exp))
    except _Captured as c:
        return c.model
    raise ConfigError("train", f"{exp.train!r} returned without calling ctx.prepare(model, optimizer)")


def run_local(exp: Experiment) -> dict[str, torch.Tensor]:
    """Run the train function in this process alone (no coordinator, no exchange); the final state_dict."""
    runtime = _LocalRuntime(exp)
    _call(exp, runtime)
    if runtime.model is None:
        raise ConfigError("train", f"{exp.train!r} returned without calling ctx.prepare(model, optimizer)")
    return {k: v.detach().clone() for k, v in runtime.model.state_dict().items()}


class _LocalRuntime(_Runtime):
    def __init__(self, exp: Experiment) -> None:
        super().__init__(exp)
        self.model: nn.Module | None = None

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model


class _WorkerRuntime(_Runtime):
    """A worker rank of a real run: the exchange through the experiment's shards."""

    def __init__(self, ctx: RankContext, hooks: dict[str, Any]) -> None:
        super().__init__(ctx.experiment)
        self.ctx, self.hooks = ctx, hooks
        self.trainer: TrainFunctionTrainer | SyncFunctionTrainer | GossipFunctionTrainer | None = None

    @property
    def rank(self) -> int:
        return self.ctx.worker_rank

    @property
    def world_size(self) -> int:
        return max(1, self.ctx.num_workers)

    @property
    def worker_index(self) -> int:
        return self.ctx.worker_index

    @property
    def is_lead(self) -> bool:
        return self.ctx.lead

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    def count(self, samples: int) -> None:
        if self.trainer is not None:
            self.trainer.stats.samples += samples

    def evaluate_with(self, fn: Callable[[], dict[str, float]]) -> None:
        self.evaluator = fn
        if self.trainer is not None:
            self.trainer.evaluator = fn

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        hooks = {k: v for k, v in self.hooks.items() if k not in ("report_final", "serving")}
        mode = mode_of(self.exp)
        if mode.barrier and not mode.rounds and not shards_step_optimizer(self.exp):
            self.trainer = SyncFunctionTrainer(self.ctx, model, wants_exchange=lambda: self.sync_grads, **hooks)
        else:
            self.trainer = (TrainFunctionTrainer if mode.servers else GossipFunctionTrainer)(self.ctx, model, **hooks)
        self.trainer.report_final = self.hooks["report_final"]
        self.trainer.evaluator = self.evaluator
        self.hooks["serving"](self.trainer.endpoint)  # a gossip worker's peers reach it there
        self.trainer.start()
        self.steps = self.trainer.progress
        self.trainer.user_computes()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.trainer is None:
            raise ConfigError("train", "optimizer.step() before ctx.prepare(model, optimizer)")
        self.trainer.user_computed()
        try:
            self.trainer.user_step(optimizer)
        finally:
            self.steps = self.trainer.progress
            self.trainer.user_computes()

    def done(self) -> bool:
        return self.trainer is not None and self.trainer.done

    def stopping(self) -> bool:
        return bool(self.hooks["should_stop"]())

    def report(self, values: dict[str, float]) -> None:
        self.hooks["on_metrics"](self.steps, values)


class _UserModel:
    """What a trainer of a train function shares: the user's model, and no evaluation of gossamer's own."""

    _user_model: nn.Module
    ctx: RankContext
    on_metrics: Hook
    profiler: StepProfiler
    clock: int
    stats: StepStats
    reports_loss = False  # the train function reports its own loss

    def _build(self) -> tuple[nn.Module, Any, Any]:
        return self._user_model.to(self.ctx.device), [], []

    #: The train function's evaluation (`TrainContext.evaluate_with`); without one it reports its own eval_*.
    evaluator: Callable[[], dict[str, float]] | None = None

    def _evaluates(self) -> bool:
        return self.evaluator is not None and self.ctx.lead

    def _evaluate(self, step: int) -> dict[str, float]:
        """The train function's evaluation, where it gave one, reported as gossamer's loop reports its own."""
        if self.evaluator is None:
            return {}
        values = {k if k.startswith("eval_") else f"eval_{k}": float(v) for k, v in self.evaluator().items()}
        self.on_metrics(step, {**values, "eval_step": float(step)})
        return values

    _t_report = 0.0
    _samples_reported = 0
    done = False
    _computing: contextlib.ExitStack | None = None

    _computing_since = 0.0
    #: Seconds the user's code computed before its latest step (the adaptive link weighs the exchange by it).
    computed_s = 0.0

    def user_computes(self) -> None:
        """From here to its next step the user's code computes: the profiler's window moves on and times it."""
        self.profiler.step(self.clock)
        self._computing = contextlib.ExitStack()
        self._computing.enter_context(self.profiler.region("compute"))
        self._computing_since = time.perf_counter()

    def user_computed(self) -> None:
        """The user's code reached its step (or returned)."""
        if self._computing is not None:
            self._computing.close()
            self._computing = None
            self.computed_s = time.perf_counter() - self._computing_since

    def _profile_end(self) -> None:
        self.user_computed()
        self.profiler.close(self.clock)

    def _user_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step, counted (a `delay` fault slows this worker's every step, as a straggler's)."""
        optimizer.step()
        self.clock += 1
        self.stats.steps += 1
        if self.ctx.step_delay_s:
            time.sleep(self.ctx.step_delay_s)

    def _counted_to_clock(self) -> None:
        """Done once this worker's own steps reach `total_steps` (gossip, sync: each worker takes every step)."""
        self.done = self.clock >= self.exp.total_steps  # type: ignore[attr-defined]
        self._report_now_and_then()

    @property
    def progress(self) -> int:
        """This worker's own steps (the trainer whose steps are the shards' versions says otherwise)."""
        return self.clock  # type: ignore[attr-defined,no-any-return]

    def _report_now_and_then(self) -> None:
        """The trainer's counters (bytes, updates, ...) once a second and at the end."""
        now = time.monotonic()
        if now - self._t_report >= 1.0 or self.done:
            since = self.stats.samples - self._samples_reported
            rate = since / max(1e-9, now - self._t_report) if self._t_report else 0.0
            self._t_report, self._samples_reported = now, self.stats.samples
            self._report(rate)  # type: ignore[attr-defined]  # the trainer's own: bytes, updates, ...


class GossipFunctionTrainer(_UserModel, GossipTrainer):
    """A train function's gossip: after each user step the parameters mix with what peers sent, and a share
    of them goes to this step's peer; `total_steps` counts each worker's steps, as in gossamer's gossip."""

    def __init__(self, ctx: RankContext, model: nn.Module, **hooks: Any) -> None:
        self._user_model = model
        super().__init__(ctx, **hooks)
        self.done = False

    def start(self) -> None:
        """Take the most advanced peer's parameters and step (a worker joining mid-run)."""
        self._apply_updates()
        self._join()
        self._last_eval = self.clock // self.exp.eval_every if self.exp.eval_every else 0
        self.done = self.clock >= self.exp.total_steps

    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.done:
            return
        self._apply_updates()
        self._user_stepped(optimizer)
        with self.profiler.region("communication"):
            if self.peer is not None and self.outer is None:
                self._bound_lag()
                self.peer.mix(self.flat)
            if self.peer is not None:
                self.peer.serve(self.flat, self.clock)
            self._node_sync()
        if self.outer is None or self.clock % self.exp.inner_steps == 0 or self.clock >= self.exp.total_steps:
            self._exchange()
        self._counted_to_clock()
        self._eval_average_when_due()

    def end(self) -> None:
        """The lead averages the peers' parameters and saves them; the others serve until the run completes."""
        self._profile_end()
        self._end_eval_gather()
        if self.done:
            self._finish_or_serve()
        elif self.peer is not None:
            self.peer.close()
        self.finished = self.done


class TrainFunctionTrainer(_UserModel, ParameterServerTrainer):
    """The exchange of a train function's worker: the user's optimizer steps here, the change goes to the shards.

    async: after each user step the change since the last pull is pushed (the shard adds it) and the
    shard's values come back; diloco: the user's optimizer is the inner one, and every `inner_steps`
    steps the round's change goes to the shards' outer optimizer (under the barrier). gossamer's built-in
    loop in async and sync pushes its gradient instead, for the shards to step the experiment's optimizer
    on (`shards_step_optimizer`), as the older trainer does.
    """

    def __init__(self, ctx: RankContext, model: nn.Module, *, on_metrics: Hook | None = None,
                 updates: Callable[[], AssignmentUpdate | None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_saved: OnSaved | None = None) -> None:
        self._user_model = model
        super().__init__(ctx, on_metrics=on_metrics, updates=updates, should_stop=should_stop, on_saved=on_saved)
        self.done = False
        self._basis: dict[int, torch.Tensor] = {}
        self._inner = 0
        #: The shards step the experiment's optimizer on this worker's gradients (gossamer's built-in loop).
        self.pushes_gradients = shards_step_optimizer(self.exp)
        self._params = list(self.layout.module.parameters())
        self._redos = 0  # sync: the steps computed again in a row (`_push_gradient`)

    def start(self) -> None:
        """Register with the shards and take the run's current values."""
        self.client.hello(fresh=True)
        self.done = self.pull()
        self._basis = {} if self.pushes_gradients else self.layout.chunk_values()
        self._exchanging = True

    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step, then the mode's exchange."""
        if self.done:
            return
        if self.pushes_gradients:  # the membership changes after the push: its gradient is of the step's workers
            self._push_gradient()
            self._apply_updates()
            self._report_now_and_then()
            self._maybe_eval(self.progress)
            return
        self._apply_updates()
        self._user_stepped(optimizer)
        if self.mode.rounds:
            self._inner += 1
            if self._inner < self.exp.inner_steps:
                return
            self._inner = 0
        change = {i: self._basis[i] - v for i, v in self.layout.chunk_values().items()}
        if self.exp.overlap:
            self._exchange_overlapped_change(change)
        else:
            self._exchange_change(change)
        self._basis = self.layout.chunk_values()
        self._report_now_and_then()
        self._maybe_eval(self.progress)

    def _push_gradient(self) -> None:
        """This step's gradient to the shards and their values back, as the older trainer's step pushes it (its
        codec, density warm-up, adaptive link and overlap); then the step is counted.

        sync: where the barrier re-formed or the shards moved on, `StepRedo`: gossamer's own loop computes the
        step again over the workers now (the older trainer's redo), so nothing is counted twice.
        """
        if self.ctx.step_delay_s:  # a `delay` fault: a straggler's every step
            time.sleep(self.ctx.step_delay_s)
        flat = _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params])
        grads = {c.index: flat[c.flat_offset:c.flat_offset + c.numel] for c in self.mine}
        generation = self.ctx.generation  # the step's: no update is taken between its compute and its push
        try:
            self.done = self._send_gradient(grads, self.computed_s)
        except ShardError as e:
            if not self.barrier or not ({REFORM, FAILED_PRECONDITION} & set(e.codes)) or self._redos >= 99:
                raise
            self.redone += 1
            self._redos += 1
            if REFORM in e.codes:
                self._await_generation(generation)
            else:
                log.info("shards moved on or rolled back (%s); pulling and computing the step again", e)
                time.sleep(0.05 * min(self._redos, 10))
                self.done = self.pull()
            raise StepRedo from e
        self._redos = 0
        self.compute_s += self.computed_s
        self.clock += 1
        self.stats.steps += 1

    def _exchange_change(self, change: dict[int, torch.Tensor]) -> None:
        """Push this step's change and take the shards' values; under a re-formed barrier, to the new round.

        A DiLoCo round's shards add up the workers' pushes and take the outer step on the sum, so each
        worker pushes its change over the workers in the round (the outer gradient is their mean), as
        gossamer's own round does; a round redone after the barrier re-formed is scaled to its new count.
        """
        scaled = 1.0  # what `change` is already multiplied by: scaled in place (the caller's own copy)
        for attempt in range(100):
            generation = self.ctx.generation
            if self.mode.rounds:
                want = 1.0 / self.ctx.num_workers
                for c in change.values():
                    c.mul_(want / scaled)
                scaled = want
            try:
                self.done = self._push_pull(change, step=self.version)
                return
            except ShardError as e:  # a re-formed barrier: the same change goes again to the new round
                if not self.barrier or REFORM not in e.codes or attempt == 99:
                    raise
                self._await_generation(generation)

    def _exchange_overlapped_change(self, change: dict[int, torch.Tensor]) -> None:
        """async with `overlap`: this step's change leaves while the user's next step is computed.

        The reply to the previous push becomes the parameters less the change made since (it is on its
        way to the shards, not in the reply yet), so nothing of this worker's is lost or counted twice;
        each change is applied on values one step older than without overlap.
        """
        if self.client.in_flight:
            with self.profiler.region("communication"):
                res = self.client.wait()
            self._note_versions(res.versions)
            self.done = self._assemble({i: v - change[i] for i, v in res.values.items()}, res.done)
        if not self.done:
            with self.profiler.region("communication"):
                self.client.push_async(change, clock=self.clock, basis=dict(self.versions))

    def _past_the_end(self) -> None:
        """Past the last step: its final counters go next (a test holds or kills it here, as gossamer's loop)."""
        hold_at("final-report", **self.client.fault_ctx)
        die_at("final-report", step=self.clock, **self.client.fault_ctx)

    @property
    def progress(self) -> int:
        """Optimizer steps of the run: shard versions, times `inner_steps` for diloco's rounds."""
        return self.version * (self.exp.inner_steps if self.mode.rounds else 1)

    def end(self) -> None:
        """The train function returned: finish the run as gossamer's own loop does."""
        self._profile_end()
        self._exchanging = False
        if self.client.in_flight and self._stopping():  # told to leave mid-overlap: the change goes or not, whole
            self.client.abandon()
        elif self.client.in_flight:  # overlap: the last change's reply (no step since: nothing to keep back)
            res = self.client.wait()
            self._note_versions(res.versions)
            self.done = self._assemble(res.values, res.done) or self.done
        if self.done:
            self._past_the_end()
            self._apply_updates()
            self._await_lead()
            if self.ctx.lead and not self._stopping():
                die_at("before-finish", step=self.progress, **self.client.fault_ctx)
                self._drop_training_state()  # before the final values come in: nothing trains again
                self.pull()
                self.finish()
        self.client.leave()
        self.client.close()
        self.finished = self.done


class SyncFunctionTrainer(TrainFunctionTrainer):
    """A train function's sync, as torch DDP: every backward pass ends with the workers' mean gradient in `.grad`.

    Each parameter's post-accumulate-grad hook queues one callback at the end of the backward pass, which pushes
    this worker's accumulated gradients to the shards under the barrier and writes the round's mean back into
    every `.grad` before `backward()` returns; the user's clipping and optimizer then see the mean, as one process
    would over all the workers' samples, and every worker takes the same step. Each push carries the parameters
    too, which the shards hold as the run's (for checkpoints and workers that join). `total_steps` counts the
    user's `optimizer.step()` calls; a shard version is one exchange.
    """

    def __init__(self, ctx: RankContext, model: nn.Module, *, wants_exchange: Callable[[], bool] = lambda: True,
                 **hooks: Any) -> None:
        super().__init__(ctx, model, **hooks)
        if ctx.local_world > 1:
            raise ConfigError("train", "a train function's sync runs one rank per node")
        self.wants_exchange = wants_exchange
        self._queued = False
        self._exchanged = False  # a backward pass since the last step ended with the workers' mean
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params if p.requires_grad]

    def start(self) -> None:
        """Register with the shards and take the run's parameters and step count (those of its last exchange)."""
        self.client.hello(fresh=True)
        self.pull()
        self.clock = max(self.client.steps.values(), default=0)  # a worker joining mid-run counts on from there
        self.done = self.clock >= self.exp.total_steps
        self._exchanging = True

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._queued and not self.done and self.wants_exchange():
            self._queued = True  # once per backward pass, whichever parameter's gradient is first
            torch.autograd.Variable._execution_engine.queue_callback(self._exchange_grads)  # type: ignore[attr-defined]

    def _exchange_grads(self) -> None:
        """End of a backward pass: the round's mean gradient into every `.grad` (the same bits on every worker)."""
        self._queued = False
        grads = _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params])
        res = self._round(grads)
        self._exchanged = True
        mean = torch.zeros_like(grads)
        for idx, v in res.values.items():
            c = self.plan.chunks[idx]
            mean[c.flat_offset:c.flat_offset + c.numel] = v.reshape(-1)
        offset = 0
        with torch.no_grad():
            for p in self._params:
                piece = mean[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(piece)
                elif bool(piece.any()):  # another worker's gradient reached it; none of the workers': left None
                    p.grad = piece.clone()

    def _round(self, grads: torch.Tensor, *, idle: bool = False) -> PullResult:
        """One exchange under the barrier: `grads` (flat) and the parameters pushed, the shards' answer."""
        self._apply_updates()
        values = _flat(self._params)
        push = {c.index: torch.cat([grads[c.flat_offset:c.flat_offset + c.numel],
                                    values[c.flat_offset:c.flat_offset + c.numel]]) for c in self.mine}
        gate_at("push", step=self.progress, **self.client.fault_ctx)
        die_at("mid-push", step=self.clock, **self.client.fault_ctx)
        t0 = time.perf_counter()
        with self.profiler.region("communication"):
            res = self._push_round(push, idle=idle)
        self.exchange_s += time.perf_counter() - t0
        self._note_versions(res.versions)
        return res

    def _push_round(self, push: dict[int, torch.Tensor], *, idle: bool) -> PullResult:
        """The push under the barrier, again where it re-formed or the shards moved on (the same gradient)."""
        for attempt in range(100):
            generation = self.ctx.generation
            try:
                res = self.client.push_pull(push, clock=self.clock, basis=self.versions, step=self.version,
                                            num_workers=self.ctx.num_workers, generation=generation, values=False,
                                            idle=idle)
                break
            except ShardError as e:  # the barrier re-formed, or the shards moved on: the same gradient goes again
                if attempt == 99 or not ({REFORM, FAILED_PRECONDITION} & set(e.codes)):
                    raise
                self.redone += 1
                if REFORM in e.codes:
                    self._await_generation(generation)
                else:
                    time.sleep(0.05 * min(attempt, 10))
                    self._note_versions(self.client.pull().versions)
        return res

    def _hold_place(self) -> None:
        """Done: push idle (the barrier's place, no gradient) for the workers still stepping (one that joined may
        be a backward or a step behind) until a round of idle pushes alone says every worker is done."""
        zeros = torch.zeros(self.plan.total_numel)
        try:
            while not self._stopping():
                step = self.version
                if max(self._round(zeros, idle=True).versions.values(), default=step) <= step:
                    return  # no version made: every worker is done
        except StepAbandoned:
            self.client.abandon()

    def user_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step on the mean gradient its backward left; counted."""
        if self.done:
            return
        if not self._exchanged:
            raise ConfigError("train", "in sync optimizer.step() steps on the workers' mean gradient, which the last "
                                       "backward() before it leaves in .grad: none since the previous step ran "
                                       "outside ctx.no_sync()")
        self._exchanged = False
        self._apply_updates()
        self._user_stepped(optimizer)
        self._counted_to_clock()
        self._maybe_eval(self.progress)

    @property
    def progress(self) -> int:
        """The user's optimizer steps (every worker takes each one)."""
        return self.clock

    def end(self) -> None:
        """The lead writes its own parameters (the shards hold those of the last exchange, a step before)."""
        self._profile_end()
        for h in self._hooks:
            h.remove()
        if self.done:
            self._hold_place()
        self._exchanging = False
        if self.done:
            self._past_the_end()
            self._await_lead()
            if self.ctx.lead and not self._stopping():
                self.finish()
        self.client.leave()
        self.client.close()
        self.finished = self.done


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors` end to end, as fp32 on the CPU (the plan's flat order, for the model's parameters)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


def run_train_function(ctx: RankContext, **hooks: Any) -> TrainFunctionTrainer | GossipFunctionTrainer:
    """Call the experiment's train function on this worker rank; the trainer that ran its exchange.

    `hooks`: on_metrics, updates, should_stop, on_saved and report_final, as the role process wires a trainer,
    and serving(endpoint), told where this worker serves once its model is prepared.
    """
    hooks.setdefault("serving", lambda endpoint: None)
    runtime = _WorkerRuntime(ctx, hooks)
    try:
        _call(ctx.experiment, runtime)
    except StepAbandoned:  # told to leave while exchanging: give the step up, as gossamer's loop does
        if isinstance(runtime.trainer, TrainFunctionTrainer):
            runtime.trainer.client.abandon()
        if runtime.trainer is not None:
            runtime.trainer.end()
        return runtime.trainer  # type: ignore[return-value]
    trainer = runtime.trainer
    if trainer is None:
        raise ConfigError("train", f"{ctx.experiment.train!r} returned without calling ctx.prepare(model, optimizer)")
    if not trainer.done and not runtime.stopping():
        trainer.end()
        raise ConfigError("train", f"{ctx.experiment.train!r} returned at step {trainer.progress} of "
                                   f"{ctx.experiment.total_steps}, before the run ended (loop until "
                                   "ctx.should_stop() or over ctx.data(...))")
    trainer.end()
    return trainer
