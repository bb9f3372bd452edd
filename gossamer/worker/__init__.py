"""Worker side: the node agent, role processes, and the per-rank training loop."""

from __future__ import annotations

from gossamer.worker.agent import AgentConfig, NodeAgent

__all__ = ["AgentConfig", "NodeAgent"]
