"""The coordinator: one facade over its parts (membership, experiments, scheduling, recovery) that server.py serves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.experiments import Experiments
from gossamer.coordinator.membership import Membership
from gossamer.coordinator.records import ExpRec
from gossamer.coordinator.recovery import Recovery
from gossamer.coordinator.scheduling import Scheduler
from gossamer.coordinator.state import CoordinatorState, wait_event
from gossamer.coordinator.store import Store
from gossamer.v1 import coordinator_pb2 as pb

__all__ = ["Coordinator", "ServingCounts", "wait_event"]


class ServingCounts(Protocol):
    """What /metrics shows of the gRPC server serving a Coordinator."""

    @property
    def restarts(self) -> int: ...

    @property
    def malformed_refused(self) -> int: ...

    @property
    def beats_served(self) -> int: ...

    @property
    def beats_dropped(self) -> dict[str, int]: ...


class Coordinator:
    """The coordinator's calls, each handed to the one part that does it; the servicers in server.py are thin RPC
    adapters over these methods.

    The parts share one `CoordinatorState` and call down, never up: `Recovery` re-plans lost roles,
    `Scheduler` binds experiments to nodes (placing backups and restores through `Recovery`),
    `Membership` keeps nodes and leases, `Experiments` keeps an experiment from submit to its end.
    A new call is a method here that forwards to the part owning it (or to a new part over the state).
    """

    #: The gRPC server serving this state: /metrics shows its restart and refusal counts.
    grpc_server: ServingCounts | None = None

    def __init__(self, config: CoordinatorConfig, store: Store | None = None) -> None:
        self.state = CoordinatorState(config, store)
        self.recovery = Recovery(self.state)
        self.scheduler = Scheduler(self.state, self.recovery)
        self.membership = Membership(self.state, self.recovery, self.scheduler)
        self.experiments = Experiments(self.state, self.recovery, self.scheduler)
        # The records and counters the HTTP side, retention and UDP beats read: the parts' own objects.
        self.config = config
        self.store = self.state.store
        self.checkpoint_root = self.state.checkpoint_root
        self.nodes = self.state.nodes
        self.exps = self.state.exps
        self.streams = self.state.streams
        self.curve = self.state.curve
        self.beat_rate = self.membership.beat_rate
        self.blind = self.membership.blind
        self.import_checker = self.experiments.import_checker
        self.step_rates = self.experiments.step_rates
        self.suspicion = self.recovery.suspicion

    async def wait_change(self, timeout: float) -> None:
        await self.state.wait_change(timeout)

    # --- membership ------------------------------------------------------------------------
    async def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        return await self.membership.join(req)

    async def heartbeat(self, node_id: str) -> bool:
        return await self.membership.heartbeat(node_id)

    async def leave(self, node_id: str, reason: str) -> None:
        await self.membership.leave(node_id, reason)

    def stream_changed(self, node_id: str, *, is_open: bool) -> None:
        """A node's assignment stream opened or closed (a closed one is evidence for the reaper)."""
        self.membership.stream_changed(node_id, is_open=is_open)

    async def reap_leases(self, lag_s: float = 0.0, *, sweep: bool = False) -> None:
        """Declare nodes lost whose lease expired or whose stream dropped with no heartbeat since."""
        await self.membership.reap_leases(lag_s, sweep=sweep)

    # --- scheduling ------------------------------------------------------------------------
    async def reconcile(self, *, changed: bool = True) -> None:
        """Start queued experiments and grow running ones with free nodes; wake the streams that changes touch."""
        await self.scheduler.reconcile(changed=changed)

    def assignments_for(self, node_id: str) -> list[pb.Assignment]:
        return self.experiments.assignments_for(node_id)

    # --- experiments -----------------------------------------------------------------------
    async def submit(self, experiment_json: str) -> str:
        return await self.experiments.submit(experiment_json)

    async def upload_workdir(self, pieces: AsyncIterator[pb.WorkdirChunk]) -> pb.UploadWorkdirResponse:
        return await self.experiments.workdirs.receive(pieces)

    def workdir_pieces(self, req: pb.FetchWorkdirRequest) -> AsyncIterator[pb.WorkdirChunk]:
        return self.experiments.workdir_pieces(req)

    def get(self, exp_id: str) -> ExpRec:
        return self.experiments.get(exp_id)

    def status(self, exp: ExpRec) -> pb.ExperimentStatus:
        return self.experiments.status(exp)

    async def cancel(self, exp_id: str) -> ExpRec:
        return await self.experiments.cancel(exp_id)

    async def report_role(self, req: pb.ReportRoleRequest) -> None:
        await self.experiments.report_role(req)

    async def report_metrics(self, req: pb.ReportMetricsRequest) -> bool:
        return await self.experiments.report_metrics(req)

    async def check_deadlines(self) -> None:
        """Act on overdue waits: a start, nodes that do not return, a run making no progress."""
        await self.experiments.check_deadlines()

    async def complete(self, req: pb.CompleteExperimentRequest) -> None:
        await self.experiments.complete(req)

    async def settle_completion(self, exp: ExpRec) -> None:
        """Mark `exp` COMPLETED once every other worker's final counters are in, or given up on."""
        await self.experiments.settle_completion(exp)

    # --- checkpoints -----------------------------------------------------------------------
    async def register_checkpoint(self, info: pb.CheckpointInfo) -> None:
        await self.experiments.register_checkpoint(info)
