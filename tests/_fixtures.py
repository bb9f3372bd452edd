"""The test harnesses behind tests/conftest.py: an in-process coordinator, cluster defaults, the experiment builder."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine, Mapping
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any, TypeVar

from gossamer.coordinator import CoordinatorConfig, CoordinatorServer
from gossamer.coordinator.http import HttpConfig
from gossamer.core.experiment import Experiment
from gossamer.tools.local_cluster import LocalCluster

__all__ = ["CLUSTER_DEFAULTS", "DIGITS", "InProcessCoordinator", "MakeCluster", "StartCoordinator", "experiment",
           "warm_context"]

T = TypeVar("T")

#: The model and dataset of nearly every test run: the digits MLP.
DIGITS: dict[str, Any] = {"model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"}
#: LocalCluster keyword arguments of `make_cluster` and `cluster`, unless a test's own (or its `cluster` marker's)
#: say otherwise. Nodes are SIGKILLed at teardown: a graceful leave took 3-7 s per node (they
#: were stopped one after the other), and a test that checks one stops the node itself.
CLUSTER_DEFAULTS: dict[str, Any] = {"heartbeat_interval": 0.5, "lease_timeout": 5.0, "stop_grace_s": 0.0}


@functools.cache
def warm_context() -> ForkServerContext:
    """Processes forked warm, as a node starts its local ranks: from this process's fork server.

    That fork server is forked from the session's zygote (conftest), torch and the role code
    already imported; a "spawn" rank imported them afresh, 3-4 s of CPU for each of the dozens
    of ranks the tests start. Started once per test process.
    """
    from gossamer.node.warm import role_context, warm_up

    warm_up()
    ctx = role_context(warm=True)
    assert isinstance(ctx, ForkServerContext)
    return ctx


def ranks_env(nproc: int) -> dict[str, str]:
    """Environment for a node of `nproc` local ranks: the GPUs hidden where fewer than `nproc`
    are visible, so that a one-GPU machine runs it on CPU with gloo (`worker join` refuses two
    ranks on one GPU; under torchrun both would take cuda:0), else nothing added."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"CUDA_VISIBLE_DEVICES": ""} if 0 < gpus < nproc else {}


def experiment(*bases: Mapping[str, Any], **overrides: Any) -> Experiment:
    """A validated digits Experiment named "exp": `bases` merged in order, then `overrides`."""
    fields: dict[str, Any] = {"name": "exp", **DIGITS}
    for base in bases:
        fields.update(base)
    fields.update(overrides)
    return Experiment(**fields)


def write_toml(path: Path, **fields: object) -> Path:
    """An experiment file at `path` holding `fields` (strings, numbers, booleans) under [experiment]."""
    lines = ["[experiment]"]
    for k, v in fields.items():
        lines.append(f"{k} = {v!r}".replace("'", '"') if not isinstance(v, bool) else f"{k} = {str(v).lower()}")
    path.write_text("\n".join(lines) + "\n")
    return path


class InProcessCoordinator:
    """A real grpc.aio coordinator on its own event loop thread, bound to a free port.

    `http=True` also serves its HTTP side (status page, /metrics) on a free port, at `base`.
    Any other keyword is a CoordinatorConfig field. `close()` may be called more than once.
    """

    def __init__(self, state_dir: Path, *, http: bool = False, **config: Any) -> None:
        self.config = CoordinatorConfig(host="127.0.0.1", port=0, state_dir=str(state_dir), **config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = CoordinatorServer(self.config, HttpConfig(host="127.0.0.1", port=0) if http else None)
        self._closed = False
        try:
            self.port: int = self.call(self.server.start())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base(self) -> str:
        """The HTTP side's root URL (http=True only)."""
        assert self.server.http_port, "started without http=True"
        return f"http://127.0.0.1:{self.server.http_port}"

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the coordinator's loop; its result (30 s at most)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.call(self.server.stop())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


#: The `start_coordinator` fixture: `(state_dir=None, *, http=False, **CoordinatorConfig fields)`.
StartCoordinator = Callable[..., InProcessCoordinator]
#: The `make_cluster` fixture: `(**LocalCluster keywords)`.
MakeCluster = Callable[..., LocalCluster]
