"""Entry points of role processes (spawned by the node agent): a parameter-server shard or a worker rank."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from multiprocessing.connection import Connection

from gossamer.core.protocol import RoleSpec
from gossamer.node._role_process import setup, stop_on_signals

__all__ = ["run_server", "run_worker_rank"]

# The node agent imports this module for the spawn targets: the roles themselves (and torch)
# are imported in the role process only, or the agent's event loop would stall for seconds
# (heartbeats missed, the node's lease lost) the first time it starts a role.


def run_server(spec: RoleSpec, conn: Connection | None = None) -> None:
    """Host parameter-server shard `spec.index` (primary or backup) until SIGTERM or the end."""
    setup(spec)
    with _logged_failure():
        from gossamer.node.server_role import ServerRole

        ServerRole(spec, conn, stop_on_signals()).run()


def run_worker_rank(spec: RoleSpec, conn: Connection | None = None) -> None:
    """Run local rank `spec.local_rank` of a worker role."""
    setup(spec)
    with _logged_failure():
        from gossamer.engine.process_group import exit_process
        from gossamer.node.worker_role import WorkerRankRole

        role = WorkerRankRole(spec, conn, stop_on_signals())
        code = role.run()
    if role.ran_process_group:
        exit_process(code)  # torch may still hold the destroyed group's threads: see exit_process
    if code:
        raise SystemExit(code)


@contextlib.contextmanager
def _logged_failure() -> Iterator[None]:
    """An exception that ends the role is logged with its traceback (so the role's log file and
    `gossamer logs` have it; multiprocessing would print it to stderr only), then raised on."""
    try:
        yield
    except Exception:
        logging.getLogger("gossamer.node.roles").exception("the role process failed")
        raise
