"""The coordinator: membership, role assignment, experiments, checkpoints (grpc.aio + SQLite)."""

from __future__ import annotations

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.server import CoordinatorServer, serve

__all__ = ["CoordinatorConfig", "CoordinatorServer", "serve"]
