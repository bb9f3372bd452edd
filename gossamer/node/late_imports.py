"""A fork server's second stage: what some roles import later (dynamo, DCP), imported once it serves, on SIGUSR1."""

from __future__ import annotations

import importlib
import signal
from types import FrameType

__all__ = ["LATE_MODULES", "SIGNAL", "forget", "install"]

#: Imported by a fork server after it can fork roles (`gossamer.node.warm`), so a fresh node's first
#: role starts without waiting for them: 3.2 s of imports here (2 s dynamo), none on an async or sync
#: worker's path. Building a torch.optim optimizer imports dynamo (a shard; a gossip or diloco worker's
#: own optimizer); a shard imports DCP with its first checkpoint.
LATE_MODULES = ("torch._dynamo", "gossamer.checkpoint.dcp_io")

#: The agent sends this to its fork server when it wants them (`NodeAgent._late_before`, `_import_late`).
SIGNAL = signal.SIGUSR1


def _import_late(signum: int, frame: FrameType | None) -> None:
    # Runs in the fork server's main thread between two of its loop's steps (select() is retried after
    # it): no thread imports while the server forks, and a fork request waits in the listener's backlog.
    signal.signal(SIGNAL, signal.SIG_IGN)  # once
    for name in LATE_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a role that needs it imports it itself and sees the error there
            pass


def install() -> None:
    """In the fork server's main thread: import `LATE_MODULES` when `SIGNAL` comes (`_fork_server_hook`)."""
    signal.signal(SIGNAL, _import_late)


def forget() -> None:
    """In a role forked from the server: the signal is no longer the server's (the default: it ends the process)."""
    signal.signal(SIGNAL, signal.SIG_DFL)
