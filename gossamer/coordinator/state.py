"""The coordinator's state that its parts share: nodes, experiments, the store, and the change signal."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.records import ExpRec, NodeRec, RoleRec
from gossamer.coordinator.store import Store
from gossamer.coordinator.streams import AssignmentStreams
from gossamer.core.errors import ConfigError
from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)


class CoordinatorState:
    """The records (loaded from the store), their persistence, and the signal that one changed.

    The coordinator's parts (membership, scheduling, recovery, experiments) each hold this one
    object; what they do to a record here is what the others see.
    """

    def __init__(self, config: CoordinatorConfig, store: Store | None = None) -> None:
        self.config = config
        self.store = store if store is not None else Store(config.state_dir)  # PgStore: the lead just won
        self.checkpoint_root = str((Path(config.state_dir) / "checkpoints").resolve())
        nodes, exps = self.store.load()
        now = time.time()
        self.nodes: dict[str, NodeRec] = {n.id: n for n in nodes}
        for n in self.nodes.values():
            # A restarted coordinator gives every live node one full lease to re-attach.
            n.last_seen = now
            n.stream_lost_at = 0.0
        self.exps: dict[str, ExpRec] = {e.id: e for e in exps}
        for e in self.exps.values():
            e.progress_unix = now  # the time the coordinator was down is not the run's to account for
        self.seq = max((e.seq for e in exps), default=0)  # the last experiment's place in the queue
        self._changed = asyncio.Event()  # replaced by a fresh one at every change
        self.streams = AssignmentStreams()
        self.curve = config.data_plane_curve
        if self.curve:
            import zmq  # not at import time: a plaintext coordinator never loads ZMQ

            if not zmq.has("curve"):
                raise ConfigError("curve", "this pyzmq/libzmq was built without CURVE support")
        self._forgetters: list[Callable[[str], None]] = []
        if nodes or exps:
            log.info("resumed state: %d nodes, %d experiments", len(nodes), len(exps))

    # --- change notification ---------------------------------------------------------------
    # An Event swapped at each change, not a Condition: on Python 3.11 a Condition.wait()
    # cancelled by wait_for at shutdown can leave its lock released, and `async with` then
    # raised "Lock is not acquired" in every stream handler, so SIGTERM did not end the process.
    async def notify(self, *, assignments: bool = True, only: ExpRec | None = None) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if only is not None:  # a change inside one experiment that took no role from anyone (a role's report)
            self.streams.wake_exactly(r.node_id for r in only.roles)
        elif assignments:
            self.streams.wake(r.node_id for exp in self.exps.values() if exp.active for r in exp.roles)

    async def wait_change(self, timeout: float) -> None:
        await wait_event(self._changed, timeout)

    # --- what an experiment's end forgets ---------------------------------------------------
    def on_forget(self, forget: Callable[[str], None]) -> None:
        """Have `forget(experiment_id)` drop a part's memory of an experiment once it ends."""
        self._forgetters.append(forget)

    def forget(self, exp_id: str) -> None:
        for forget in self._forgetters:
            forget(exp_id)

    # --- records -----------------------------------------------------------------------------
    def name(self, node_id: str) -> str:
        node = self.nodes.get(node_id)
        return node.name if node else node_id

    def bind(self, exp: ExpRec, node: NodeRec, role: pb.Role.ValueType, index: int) -> None:
        node.experiment_id = exp.id
        node.state = pb.NODE_STATE_BUSY
        exp.roles.append(RoleRec(node_id=node.id, role=role, index=index, state=pb.ROLE_STATE_UNSPECIFIED))

    async def release_if_idle(self, exp: ExpRec, node_id: str) -> None:
        """A node left with no role in `exp` is free for other work again."""
        node = self.nodes.get(node_id)
        if node is None or node.experiment_id != exp.id or any(r.node_id == node_id for r in exp.roles):
            return
        node.experiment_id = ""
        if node.alive:
            node.state = pb.NODE_STATE_READY
        await self.store.save_node(node)

    async def recovery_metric(self, exp: ExpRec, add: dict[str, float]) -> None:
        await self.store.add_metrics(exp.id, [exp.add_recovery(add, time.time())])


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Wait for `event` at most `timeout` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass
