"""gossamer: decentralized, asynchronous, elastic training for PyTorch."""

from __future__ import annotations

from gossamer.checkpoint import load_checkpoint
from gossamer.client import Client, Job, Result
from gossamer.errors import (
    CheckpointError,
    ConfigError,
    GossamerError,
    NotFoundError,
    ProtocolError,
    ShardError,
    UnavailableError,
)
from gossamer.experiment import Experiment

__version__ = "0.1.0"

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
