"""Worker side: the node agent (`gossamer.worker.agent`), role processes, and the per-rank training loop.

Nothing is imported here: a role process, forked warm from its node's fork server, would otherwise
import the agent and the coordinator's failover rules it never runs (0.2 s of a fresh node's first step).
"""

from __future__ import annotations
