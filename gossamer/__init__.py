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
    "UnavailableError",
    "load_checkpoint",
]
