"""Entry points of role processes (spawned by the node agent): a parameter-server shard or a worker rank."""

from __future__ import annotations

from multiprocessing.connection import Connection

from gossamer.protocol import RoleSpec
from gossamer.worker._role_process import setup, stop_on_signals
from gossamer.worker.server_role import ServerRole
from gossamer.worker.worker_role import WorkerRankRole

__all__ = ["run_server", "run_worker_rank"]


def run_server(spec: RoleSpec, conn: Connection | None = None) -> None:
    """Host parameter-server shard `spec.index` (primary or backup) until SIGTERM or the end."""
    setup(spec)
    ServerRole(spec, conn, stop_on_signals()).run()


def run_worker_rank(spec: RoleSpec, conn: Connection | None = None) -> None:
    """Run local rank `spec.local_rank` of a worker role."""
    setup(spec)
    WorkerRankRole(spec, conn, stop_on_signals()).run()
