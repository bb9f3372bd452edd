"""`Experiment(train="pkg.mod:fn")`: the user's own loop, gossamer's exchange in its optimizer step (sync: backward)."""

from __future__ import annotations

import collections
import contextlib
import logging
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from gossamer.core.errors import ConfigError, GossamerError
from gossamer.core.experiment import Experiment
from gossamer.core.import_check import resolve
from gossamer.core.modes import mode_of
from gossamer.core.train_path import shards_step_optimizer
from gossamer.engine import sampler
from gossamer.engine.rank import RankContext, StepAbandoned
from gossamer.training.gossip.gossip_function import GossipFunctionTrainer
from gossamer.training.shards.gradient_push import GradientPushTrainer
from gossamer.training.shards.shard_function import ShardFunctionTrainer

log = logging.getLogger(__name__)

T = TypeVar("T", torch.Tensor, list[Any])

__all__ = ["GossamerOptimizer", "ShardStepped", "TrainContext", "capture_model", "function_trainer", "run_local",
           "run_train_function"]


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
    def local_rank(self) -> int:
        return 0

    @property
    def local_world_size(self) -> int:
        return 1

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def worker_rank(self) -> int:
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
        """This process's rank among the run's current processes (worker rank x local ranks + local rank; changes
        as workers join and leave): with your own DataLoader, read the `rank`-th of `world_size` shares."""
        return self._runtime.rank

    @property
    def world_size(self) -> int:
        """The run's processes now: the workers times each node's local ranks (every node runs as many)."""
        return self._runtime.world_size

    @property
    def worker_index(self) -> int:
        """This worker's index in the run: unlike `rank`, kept while others join and leave (its own sample stream)."""
        return self._runtime.worker_index

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (`worker join --nproc-per-node N`: 0 to N - 1; one GPU each)."""
        return self._runtime.local_rank

    @property
    def local_world_size(self) -> int:
        """The processes of this node (`--nproc-per-node`): each runs the train function, and every backward pass
        ends with the node's mean gradient in `.grad` (as torch DDP's), so they all take the same step."""
        return self._runtime.local_world_size

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
        """This process's batches of `dataset` (map-style, `IterableDataset` or a Hugging Face dataset).

        A map-style set is sampled deterministically from the experiment's seed, an independent
        stream per worker (a node of several local ranks deals each of its batches of `batch_size` x ranks
        out to them, `batch_size` each); an iterable one is dealt out by the current rank. Ends when the run
        is done, cancelled, or this node leaves.

        sync with `global_batch_size` G: the run's i-th batch is the same G samples whatever the number of
        workers (drawn from the seed, or the stream's next G), and each worker gets its rank's share of them
        (G / workers, the first ones one more where G does not divide), cut again among its local ranks:
        N workers' mean gradient is one process's over G samples. `batch_size`, if given, must then be G.
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
                idx = self._share(picked).tolist()
            elif shuffle:  # the node's own stream, its batch dealt out to its local ranks
                local = self._runtime.local_world_size
                node = sampler.async_batch(n, size * local, batch, self.experiment.seed, self.worker_index)
                idx = sampler.even_split(node, local, self._runtime.local_rank).tolist()
            else:
                start = (batch * self.world_size + self.rank) * size
                idx = [(start + i) % n for i in range(min(size, n))]
            self.count(len(idx))
            yield collate([dataset[i] for i in idx])
            batch += 1

    def _share(self, items: T) -> T:
        """This process's share of one global batch: its worker's share, then its local rank's of that."""
        r = self._runtime
        return sampler.even_split(sampler.even_split(items, r.num_workers, r.worker_rank), r.local_world_size,
                                  r.local_rank)

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
                mine = self._share(items) if split else items
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
        self.trainer: ShardFunctionTrainer | GossipFunctionTrainer | None = None

    @property
    def rank(self) -> int:
        return self.worker_rank * self.local_world_size + self.local_rank

    @property
    def world_size(self) -> int:
        return self.num_workers * self.local_world_size

    @property
    def worker_index(self) -> int:
        return self.ctx.worker_index

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def local_world_size(self) -> int:
        return self.ctx.local_world

    @property
    def num_workers(self) -> int:
        return max(1, self.ctx.num_workers)

    @property
    def worker_rank(self) -> int:
        return self.ctx.worker_rank

    @property
    def is_lead(self) -> bool:
        return self.ctx.lead

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    def count(self, samples: int) -> None:
        if self.trainer is not None:  # the node's (local rank 0 reports it): its ranks take equal shares, to one sample
            self.trainer.stats.samples += samples * self.local_world_size

    def evaluate_with(self, fn: Callable[[], dict[str, float]]) -> None:
        self.evaluator = fn
        if self.trainer is not None:
            self.trainer.evaluator = fn

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        hooks = {k: v for k, v in self.hooks.items() if k not in ("report_final", "serving", "flush")}
        self.trainer = function_trainer(self.exp)(self.ctx, model, **hooks)
        self.trainer.wants_exchange = lambda: self.sync_grads
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
        if self.trainer is not None:  # several local ranks: the stop they agreed on
            return self.trainer.node_stopping()
        return bool(self.hooks["should_stop"]())

    def report(self, values: dict[str, float]) -> None:
        self.hooks["on_metrics"](self.steps, values)


def function_trainer(exp: Experiment) -> type[ShardFunctionTrainer] | type[GossipFunctionTrainer]:
    """The trainer a worker of `exp` runs its train function over: its mode's unit (`Mode.function_trainer`), or
    gossamer's built-in loop's gradient push where the shards step the experiment's optimizer."""
    if shards_step_optimizer(exp):
        return GradientPushTrainer
    cls = resolve(mode_of(exp).function_trainer)
    if not (isinstance(cls, type) and issubclass(cls, ShardFunctionTrainer | GossipFunctionTrainer)):
        raise TypeError(f"mode {mode_of(exp).label}: {mode_of(exp).function_trainer} is not a train function's trainer")
    return cls


def run_train_function(ctx: RankContext, **hooks: Any) -> ShardFunctionTrainer | GossipFunctionTrainer:
    """Call the experiment's train function on this worker rank; the trainer that ran its exchange.

    `hooks`: on_metrics, updates, should_stop, on_saved and report_final, as the role process wires a trainer,
    serving(endpoint), told where this worker serves once its model is prepared, and flush(), which delivers this
    process's reports (the train function's closing ones, before the run completes).
    """
    hooks.setdefault("serving", lambda endpoint: None)
    hooks.setdefault("flush", lambda: None)
    runtime = _WorkerRuntime(ctx, hooks)
    try:
        _call(ctx.experiment, runtime)
    except StepAbandoned:  # told to leave while exchanging: give the step up, as gossamer's loop does
        if isinstance(runtime.trainer, ShardFunctionTrainer):
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
    hooks["flush"]()
    if ctx.local_world > 1:  # every rank's own reports are in before rank 0 says the node is done or completes
        dist.barrier()
    trainer.end()
    return trainer
