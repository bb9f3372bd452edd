"""gossamer: decentralized, asynchronous, elastic training for PyTorch."""

from __future__ import annotations

from gossamer.checkpoint import load_checkpoint
from gossamer.core.errors import (
    CheckpointError,
    ConfigError,
    GossamerError,
    NotFoundError,
    ProtocolError,
    ShardError,
    UnavailableError,
)
from gossamer.core.experiment import Experiment
from gossamer.core.version import __version__ as __version__
from gossamer.tools.client import Client, Job, Result

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gossamer.training.train_function import TrainContext, run_local


def __getattr__(name: str) -> object:
    # The train function's names import torch: only when asked for, so `import gossamer` stays light.
    if name in ("TrainContext", "run_local"):
        from gossamer.training import train_function

        return getattr(train_function, name)
    raise AttributeError(f"module 'gossamer' has no attribute {name!r}")

__all__ = [
    "CheckpointError",
    "Client",
    "ConfigError",
    "Experiment",
    "GossamerError",
    "Job",
    "NotFoundError",
    "ProtocolError",
    "Result",
    "ShardError",
    "TrainContext",
    "UnavailableError",
    "load_checkpoint",
    "run_local",
]
