"""The node agent (`gossamer worker join`): joins, heartbeats, and runs assigned roles in spawned processes.

Under torchrun or srun with several processes on a node, local rank 0 runs the agent and the
other local ranks attach to it (`gossamer.node.attach`) to run its worker ranks.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field, replace

import grpc

from gossamer.checkpoint.file_server import CheckpointFileServer
from gossamer.core.errors import AuthError, ConfigError, UnavailableError
from gossamer.core.modes import resolve
from gossamer.core.pids import pid_alive
from gossamer.core.protocol import (
    AssignmentUpdate,
    LeaseRenewal,
    RoleSpec,
    ShardStop,
    shard_lease_s,
)
from gossamer.core.role_log_names import log_stem
from gossamer.node._role_process import EXIT_REPORTED
from gossamer.node.attach import AttachedRanks, RolePipe, RoleProcess
from gossamer.node.beat_sender import UdpBeats
from gossamer.node.heartbeat import HeartbeatThread
from gossamer.node.host_load import spare_cpus
from gossamer.node.late_imports import LATE_MODULES
from gossamer.node.launcher import Launch, default_run_dir, ensure_run_dir, visible_cuda_devices
from gossamer.node.leave import GraceSplit, deliver_leave
from gossamer.node.node_metrics import NodeMetrics
from gossamer.node.ports import reserve_port
from gossamer.node.role_log_files import RoleLogs
from gossamer.node.warm import (
    import_late,
    role_context,
    stop_fork_server,
    wait_for_fork_server,
    warm_up_in_background,
)
from gossamer.node.workdir_cache import WorkdirCache, workdir_of
from gossamer.security.channel import (
    ChannelSecurity,
    coordinator_addresses,
    explain_rpc_error,
    open_aio_channel,
)
from gossamer.security.curve import CurveKeyPair
from gossamer.security.sender_tokens import log_subject, new_key
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: A warm node that has run no role for this long, on a host with a core to spare, has its fork server
#: import the rest (`_import_late`).
LATE_IMPORTS_IDLE_S = 10.0
LATE_IMPORTS_POLL_S = 2.0


def _needs_late(a: pb.Assignment) -> str:
    """Why `a`'s role needs the fork server's late imports (`late_imports.LATE_MODULES`), or ""."""
    if a.role == pb.ROLE_PARAMETER_SERVER:
        return "a shard"
    try:
        doc = json.loads(a.experiment_json)
        own_optimizer = resolve(doc["mode"], doc.get("outer_step") or "").worker_optimizer
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""  # the role reports what is wrong with its experiment
    return "a worker with its own optimizer" if own_optimizer else ""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """`gossamer worker join` flags."""

    coordinator: str
    name: str = ""
    address: str = ""  # host other nodes reach this node's shard on; default: the route to the coordinator
    nproc_per_node: int = 1
    spot: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    grace_s: float = 30.0
    threads_per_role: int = 1
    #: Serve this node's Prometheus /metrics on this port (0: a free one, logged); None: not served.
    metrics_port: int | None = None
    metrics_host: str = ""  # address /metrics binds; default: `address`
    log_level: str = "INFO"
    #: TLS settings and token for the coordinator; role processes get the same (as file paths).
    security: ChannelSecurity | None = None
    log_format: str = "text"  # text | json, for the agent and its role processes
    #: The launcher (torchrun, srun) that started this process: with several processes on this node
    #: they are its local ranks (`nproc_per_node` of them), and the others attach to this agent.
    launch: Launch = field(default_factory=Launch)
    run_dir: str = ""  # where the attach socket lives; default `launcher.default_run_dir()`
    attach_timeout_s: float = 120.0  # how long the other local ranks have to attach before the join
    #: Fork role processes from a server that imported torch and the role code while the node
    #: waited (`gossamer.node.warm`); False: a fresh interpreter per role, seconds slower.
    warm_roles: bool = True
    #: Modules the fork server imports too (the user's model code, `transformers`): once, not per role.
    preload: tuple[str, ...] = ()
    #: Give up (UnavailableError, exit code 3) when the coordinator has not answered a join for this long; 0: never.
    join_timeout_s: float = 0.0
    #: Where this node's roles write checkpoints, in place of the assignment's checkpoint_dir ("": that one).
    checkpoint_dir: str = ""
    #: Where role processes' logs and last tracebacks go (`<log_dir>/<node id>/<experiment>/`), served to
    #: `gossamer logs` through the coordinator; "": `<run dir>/logs`.
    log_dir: str = ""

    def __post_init__(self) -> None:
        for one in coordinator_addresses(self.coordinator):  # several: one leads (docs/ha.md)
            if ":" not in one:
                raise ConfigError("coordinator", f"expected HOST:PORT, got {one!r}")
        if self.nproc_per_node < 1:
            raise ConfigError("nproc_per_node", "must be >= 1")
        if self.grace_s < 0:
            raise ConfigError("grace_s", "must be >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", f"must be in 0..65535, got {self.metrics_port}")
        if self.launch.shared and self.nproc_per_node != self.launch.local_world:
            raise ConfigError("nproc_per_node", f"{self.nproc_per_node} conflicts with the {self.launch.local_world} "
                                                f"processes {self.launch.source} started on this node")
        if self.launch.shared and self.launch.local_rank != 0:
            raise ConfigError("launcher", f"local rank {self.launch.local_rank} attaches to local rank 0's agent")
        if self.attach_timeout_s <= 0:
            raise ConfigError("attach_timeout_s", "must be > 0")


def route_address(coordinator: str) -> str:
    """The local IP used to reach the coordinator (the first of several; loopback when it is local)."""
    host = coordinator_addresses(coordinator)[0].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "127.0.0.1", "::1", ""):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


@dataclass
class _Running:
    procs: list[RoleProcess]
    pipes: list[RolePipe]
    assignment: pb.Assignment
    stopping: bool = False
    reported: bool = False
    failed_at: float = 0.0
    #: An assignment of the same role that this process cannot take (a primary made a backup:
    #: the coordinator put a new backup here after this process failed); started once it exits.
    successor: pb.Assignment | None = None
    #: The local ranks' master port, held bound until the role ends (`reserve_port`).
    port_hold: socket.socket | None = None

    def forget(self) -> None:
        """The role's processes are gone: close its pipes and give its port back."""
        for pipe in self.pipes:
            pipe.close()
        if self.port_hold is not None:
            self.port_hold.close()


class NodeAgent:
    """Keeps this node joined and its role processes matching the coordinator's assignment set."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.address = config.address or route_address(config.coordinator)
        self.node_id = ""
        # Proposed in the first Join, so a retry after a lost answer re-attaches to the record
        # that Join made instead of making a second node (an orphan left READY until its lease ran out).
        self._join_id = uuid.uuid4().hex[:12]
        self._join_sent = False  # a Join timed out: the coordinator may still register this node
        self.name = config.name
        self.heartbeat_s = 1.0
        self.lease_s = 0.0  # how long a heartbeat the coordinator acknowledged lets this node's shards acknowledge
        self.lease_until = 0.0  # time.monotonic() until which they may (0: no lease yet, or revoked)
        self.running: dict[tuple[str, int, int], _Running] = {}
        self.finished: set[tuple[str, int, int]] = set()
        self._stop = asyncio.Event()
        self._last_serial = 0
        self._channel: grpc.aio.Channel | None = None
        self.metrics: NodeMetrics | None = None
        self._stub: pb_grpc.NodeServiceStub | None = None
        # This node's data-plane identity; its secret goes only to this node's role processes.
        self.curve_keys = _curve_keypair()
        # Lends this node's shard checkpoint files to a shard restored on another node (docs/reliability.md).
        self.files = CheckpointFileServer(new_key(), (self.curve_keys.public, self.curve_keys.secret)
                                          if self.curve_keys else None)
        if config.checkpoint_dir:
            self.files.add_root(config.checkpoint_dir)
        # The same server lends the role logs, to the coordinator only (a token of another subject).
        self.files.add_op("logs", log_subject, lambda experiment, req: self.role_logs.answer(experiment, req))
        self.files_endpoint = ""
        self.curve = False  # the coordinator's answer: the data plane runs CurveZMQ
        self.udp_beats = UdpBeats(config.coordinator)  # keyed by each Join; used by the heartbeat thread
        #: The other local ranks of a torchrun/srun launch (None: this agent spawns every rank).
        self.attached: AttachedRanks | None = None
        self.exit_code = 0  # of `gossamer worker join`: 1 when an attached local rank was lost
        self._reason = "signal"
        self._leaving = False  # Leave sent: an unknown-node heartbeat answer is expected, not a cue to rejoin
        self._beat_warned = False  # a failed heartbeat was logged: say when one gets through again
        self._rejoin: asyncio.Task[None] | None = None  # joining again after the coordinator counted this node lost
        self._roles = role_context(warm=False)  # until the fork server is warm (`_warm_up`)
        self._warm: asyncio.Task[None] | None = None
        self._late_asked = False  # the fork server was told to import LATE_MODULES (`_import_late`, `_late_before`)
        self.workdirs = WorkdirCache(os.path.join(config.run_dir or default_run_dir(), "workdirs"))

    # --- lifecycle ---------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            if self.config.launch.shared and not await self._await_local_ranks():
                return
            await self._run()
        finally:
            if self.attached is not None:
                await self.attached.close()
            stop_fork_server()

    async def _await_local_ranks(self) -> bool:
        """Listen for the other local ranks and wait until all attached (False: stopped meanwhile).

        The node joins only then, so the local ranks it advertises are really there.
        """
        launch = self.config.launch
        self.attached = AttachedRanks(launch, launch.socket_path(self.config.run_dir), grace_s=self.config.grace_s)
        await self.attached.start()
        waiting = asyncio.create_task(self.attached.wait_all())
        stopping = asyncio.create_task(self._stop.wait())
        await asyncio.wait({waiting, stopping}, timeout=self.config.attach_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        stopping.cancel()
        if self._stop.is_set():
            return False
        if missing := self.attached.missing():
            raise UnavailableError(f"local ranks {missing} of this {launch.source} launch did not attach to "
                                   f"{self.attached.path} within {self.config.attach_timeout_s:.0f} s")
        log.info("all %d local ranks of %s are here", launch.local_world, launch.source)
        return True

    async def _run(self) -> None:
        self.files_endpoint = self.files.start(self.address)
        try:
            await self._serve_node()
        finally:
            self.files.stop()

    async def _serve_node(self) -> None:
        self._channel = open_aio_channel(self.config.coordinator, self.config.security)
        self._stub = pb_grpc.NodeServiceStub(self._channel)
        self._warm = asyncio.create_task(self._warm_up())  # beside the join: a node is warm by its first role
        await self._join()
        if not self.node_id:  # stopped before the coordinator ever answered
            log.info("stopped before joining %s", self.config.coordinator)
            self._warm.cancel()
            await self._leave_unanswered_join()
            await self._channel.close()
            return
        if self.config.metrics_port is not None:
            await self._serve_metrics()
        beats = HeartbeatThread(self.config.coordinator, self.config.security, node_id=lambda: self.node_id,
                                interval=lambda: self.heartbeat_s, on_answer=self._heartbeat_answered,
                                loop=asyncio.get_running_loop(), udp=self.udp_beats)
        beats.start()
        tasks = [asyncio.create_task(t) for t in (self._watch(), self._monitor(), self._import_late())]
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        # Heartbeats go on while the roles stop, so a slow graceful exit never looks like a loss.
        await self.shutdown(self._reason)
        beats.stop()

    async def _warm_up(self) -> None:
        if not self.config.warm_roles:
            return
        try:
            took = await asyncio.wrap_future(warm_up_in_background(self.config.preload))
        except Exception as e:  # noqa: BLE001 (a preloaded module that fails): start roles cold, just slower
            log.warning("role processes start cold (a fresh interpreter each): fork server failed: %s", e)
            return
        self._roles = role_context(warm=True)
        log.info("role processes start warm (torch, the role code%s imported in %.1f s)",
                 "".join(f", {m}" for m in self.config.preload), took)

    async def _import_late(self) -> None:
        """Have the fork server import `late_imports.LATE_MODULES` once this node has run no role for
        `LATE_IMPORTS_IDLE_S` and its host has a core to spare (`spare_cpus`): an idle standby's later
        roles then start without them (`_late_before` does it before a role that needs them).

        Never beside a running role: the imports are seconds of CPU that role would share, and a role
        forked meanwhile would wait for them.
        """
        if self._warm is None:
            return
        await self._warm
        idle_since = time.monotonic()
        while not self._late_asked and self._roles is role_context(warm=True):
            await asyncio.sleep(LATE_IMPORTS_POLL_S)
            if self.running:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= LATE_IMPORTS_IDLE_S and await spare_cpus() >= 1.0:
                if not self._late_asked and not self.running:
                    self._ask_late("idle")

    async def _late_before(self, assignments: list[pb.Assignment]) -> None:
        """Before starting new roles: the fork server's late imports first, when one of them needs them.

        A shard builds an optimizer (torch.optim imports dynamo) and writes checkpoints (DCP); so does a
        gossip or diloco worker (its own optimizer). Imported in the fork server, they cost that role what
        importing them itself would, and no later role here pays them again. An async or sync worker of
        the parameter servers needs neither: it forks at once (a fresh node's first step 1.7 s sooner).
        Waited for off the event loop, which meanwhile serves the assignment stream and the shards' leases.
        """
        if self._late_asked or self._roles is not role_context(warm=True):
            return
        why = next((w for a in assignments if self._key(a) not in self.running and (w := _needs_late(a))), "")
        if why:
            self._ask_late(why)
            try:
                await asyncio.to_thread(wait_for_fork_server)
            except Exception as e:  # noqa: BLE001 - the role's own start reports a fork server that is gone
                log.warning("waiting for the fork server's late imports failed: %s", e)

    def _ask_late(self, why: str) -> None:
        self._late_asked = True
        log.info("the fork server imports %s (%s)", ", ".join(LATE_MODULES), why)
        import_late()

    async def _serve_metrics(self) -> None:
        """This node's Prometheus /metrics (`--metrics-port`), fed by its role processes."""
        name = self.config.name or f"{socket.gethostname() or 'node'}-{self.node_id[:6]}"
        self.metrics = NodeMetrics(name, roles=self._role_processes)
        self.metrics.node_id = self.node_id
        host = self.config.metrics_host or self.address
        try:
            port = await self.metrics.start(host, self.config.metrics_port or 0)
        except OSError as e:
            raise ConfigError("metrics_port", f"cannot serve /metrics on {host}:{self.config.metrics_port}: {e}") from None
        log.info("node metrics on http://%s:%d/metrics", host, port)

    def _role_processes(self) -> dict[tuple[str, str, int], int]:
        return {(exp, "ps" if role == pb.ROLE_PARAMETER_SERVER else "worker", index): sum(p.is_alive() for p in run.procs)
                for (exp, role, index), run in self.running.items()}

    async def shutdown(self, reason: str) -> None:
        """Leave gracefully within `grace_s` (a spot notice gives about 30 s).

        1. Workers finish (or abandon) their step, LEAVE the shards and exit: an update is
           applied whole or not at all.
        2. A primary shard with no backup stops acknowledging, writes its state as the newest
           checkpoint and registers it, then exits (`ShardStop`): the restore the Leave brings
           about takes that checkpoint and loses nothing acknowledged.
        3. Leave the coordinator: it promotes the backups of shards hosted here and points
           the workers at them.
        4. Shard processes stop. Their backups already hold every acknowledged update, and a
           push caught in between is re-sent by its worker and applied once.
        """
        t0 = time.monotonic()
        deadline = t0 + self.config.grace_s
        log.info("leaving (%s): stopping %d role(s) within %.0f s", reason, len(self.running), self.config.grace_s)
        split = GraceSplit.of(self.config.grace_s)
        workers = {k: r for k, r in self.running.items() if k[1] != pb.ROLE_PARAMETER_SERVER}
        await self._stop_runs(workers, split.workers_s(deadline - time.monotonic()))
        assert self._stub is not None
        await self._final_checkpoints(split.checkpoints_s(deadline - time.monotonic()))
        self._leaving = True
        failed = await deliver_leave(self._stub, pb.LeaveRequest(node_id=self.node_id, reason=reason),
                                     until=split.leave_until(time.monotonic(), deadline))
        if failed is not None:
            log.warning("Leave not delivered (%s); the lease will expire instead", failed.name)
        elif self.running:  # let workers pick up the promoted backups before the shards go
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        await self._stop_runs(dict(self.running), max(0.0, deadline - time.monotonic()))
        if self._channel is not None:
            await self._channel.close()
        if self.metrics is not None:
            await self.metrics.stop()
        log.info("left the cluster in %.1f s", time.monotonic() - t0)

    async def _final_checkpoints(self, seconds: float) -> None:
        """Every primary shard here with no backup assigned writes its final checkpoint within `seconds` and exits.

        Before the Leave: once the coordinator hears of it, it restores those shards elsewhere from
        the newest checkpoint it can find, and the coordinator may be gone by then (a batch job's end).
        A shard still running after `seconds` (and a second for its exit) is stopped.
        """
        alone = {k: r for k, r in self.running.items()
                 if k[1] == pb.ROLE_PARAMETER_SERVER and r.assignment.replica == 0 and not r.assignment.backup_endpoint}
        if not alone:
            return
        for run in alone.values():
            run.stopping = True  # its exit is no failure
            self._tell(run, ShardStop(checkpoint_s=seconds))
        until = time.monotonic() + seconds + 1.0
        while time.monotonic() < until and any(_alive(p) for r in alone.values() for p in r.procs):
            await asyncio.sleep(0.05)
        await self._stop_runs(alone, 0.0)

    async def _leave_unanswered_join(self) -> None:
        """A Join that timed out may still be served once the coordinator catches up (it names the node by
        `_join_id`): leave under that id, or the coordinator would list a node nobody runs, and could give
        it roles, until its lease ran out."""
        if not self._join_sent:
            return
        assert self._stub is not None
        until = time.monotonic() + min(5.0, 0.25 * self.config.grace_s)
        failed = await deliver_leave(self._stub, pb.LeaveRequest(node_id=self._join_id, reason="stopped while joining"),
                                     until=until)
        if failed is None:
            log.info("left: the coordinator had registered the unanswered Join")
        elif failed != grpc.StatusCode.NOT_FOUND:
            log.warning("Leave of the unanswered Join not delivered (%s); if the coordinator registers it, "
                        "its lease will expire", failed.name)

    async def _join(self) -> None:
        assert self._stub is not None
        req = pb.JoinRequest(
            name=self.config.name, address=self.address, hostname=socket.gethostname(), spot=self.config.spot,
            labels=self.config.labels, cpus=os.cpu_count() or 1, gpus=visible_cuda_devices(),
            nproc_per_node=self.config.nproc_per_node, node_id=self.node_id or self._join_id,
            curve_public_key=self.curve_keys.public if self.curve_keys else "",
            checkpoint_endpoint=self.files_endpoint, checkpoint_secret=self.files.secret,
        )
        delay, t0, next_note = 0.5, time.monotonic(), 0.0
        while not self._stop.is_set():
            try:
                sent = time.monotonic()
                resp = await self._stub.Join(req, timeout=5.0)
                self.node_id = resp.node_id
                self.lease_s = shard_lease_s(resp.lease_timeout_s, resp.heartbeat_interval_s)
                self._renew_lease(sent)
                # The name the coordinator gives a node that named none (its join()).
                self.name = self.config.name or f"{socket.gethostname() or 'node'}-{self.node_id[:6]}"
                from gossamer.core.logs import set_context

                set_context(node=self.name)
                self.heartbeat_s = resp.heartbeat_interval_s
                self.curve = resp.curve
                self.udp_beats.rekey(resp.beat_port, resp.beat_key, lease_s=resp.lease_timeout_s)
                log.info("joined %s as node %s (address %s)", self.config.coordinator, self.node_id, self.address)
                return
            except grpc.RpcError as e:
                # Sent, but the answer did not come in time (a refused connection never reached it).
                self._join_sent |= e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                # A refused token or a TLS mismatch will not fix itself: stop with the reason.
                err = await asyncio.to_thread(explain_rpc_error, e, self.config.coordinator, self.config.security)
                if isinstance(err, AuthError):
                    raise err from None
                waited = time.monotonic() - t0
                limit = self.config.join_timeout_s if not self.node_id else 0.0  # a rejoin waits as long as it takes
                if limit and waited >= limit:
                    raise UnavailableError(f"no answer from the coordinator at {self.config.coordinator} "
                                           f"within --join-timeout {limit:g} s ({e.code().name})") from None
                if waited >= next_note:  # keep saying so: a wrong address must not look like a quiet success
                    log.warning("waiting for the coordinator at %s for %.0f s (%s)%s", self.config.coordinator,
                                waited, e.code().name, "; Ctrl-C stops" if not limit else f"; giving up at {limit:g} s")
                    next_note = waited + 5.0
                await asyncio.sleep(min(delay, limit - waited) if limit else delay)
                delay = min(5.0, delay * 2)

    def _heartbeat_answered(self, sent: float, answer: bool | grpc.RpcError) -> None:
        """A heartbeat sent at `sent` (HeartbeatThread) was answered: renew the shards' lease, or rejoin."""
        if isinstance(answer, grpc.RpcError):
            if answer.code() == grpc.StatusCode.UNAUTHENTICATED:
                log.error("coordinator refused this node's token (%s); leaving", answer.details())
                self._stop.set()
            elif not self._beat_warned:
                log.warning("heartbeat failed (%s); roles keep running, retrying", answer.code())
                self._beat_warned = True
            return
        if self._beat_warned:
            log.info("coordinator reachable again")
            self._beat_warned = False
        if answer:
            self._renew_lease(sent)
        elif not self._leaving and self._rejoin is None:
            # Counted lost: its shards may have been promoted elsewhere. Those running here
            # never acknowledge again (the new assignment set stops them).
            log.warning("coordinator does not know this node; fencing its shards and joining again")
            self.lease_until = 0.0
            self._tell_shards(LeaseRenewal(until=0.0))
            self._rejoin = asyncio.create_task(self._join_again())

    async def _join_again(self) -> None:
        try:
            await self._join()
        finally:
            self._rejoin = None

    async def _watch(self) -> None:
        assert self._stub is not None
        while True:
            try:
                stream = self._stub.WatchAssignments(pb.WatchAssignmentsRequest(node_id=self.node_id))
                async for aset in stream:
                    if aset.serial >= self._last_serial:
                        self._last_serial = aset.serial
                        if self._warm is not None:
                            # Roles start from the warm fork server. The stream is open meanwhile: its
                            # drop is how the coordinator sees this node die (kill -9) within 2 heartbeats.
                            await self._warm
                        await self._late_before(list(aset.assignments))
                        self._apply(await self.workdirs.ready(self._stub, self.node_id, list(aset.assignments)))
            except grpc.RpcError as e:
                log.debug("assignment stream ended (%s); reconnecting", e.code())
            await asyncio.sleep(1.0)

    # --- lease --------------------------------------------------------------------------
    def _renew_lease(self, sent: float) -> None:
        """The coordinator answered a heartbeat (or join) sent at `sent`: shards may acknowledge until
        `sent + lease_s`, before the coordinator, counting from when it received it, may call this node lost."""
        self.lease_until = max(self.lease_until, sent + self.lease_s)
        self._tell_shards(LeaseRenewal(until=self.lease_until))

    def _tell_shards(self, lease: LeaseRenewal) -> None:
        for run in self.running.values():
            if run.assignment.role == pb.ROLE_PARAMETER_SERVER:
                self._tell(run, lease)

    # --- roles -------------------------------------------------------------------------
    @property
    def role_logs(self) -> RoleLogs:
        """This node's role logs (under its node id: agents of one host share the log directory).

        Not in an explicit `run_dir`: that holds the agent's sockets only and is left empty when it exits."""
        return RoleLogs(os.path.join(self._log_base, self.node_id or "unjoined"))

    @functools.cached_property
    def _log_base(self) -> str:
        """`log_dir`, or `logs` in the default run dir, made private (0700) once, not at every request for a log."""
        return self.config.log_dir or str(ensure_run_dir() / "logs")

    @staticmethod
    def _key(a: pb.Assignment) -> tuple[str, int, int]:
        # Not the generation or replica: membership changes and promotions reach the running
        # process through its pipe, they never restart it.
        return (a.experiment_id, a.role, a.index)

    def _apply(self, assignments: list[pb.Assignment]) -> None:
        wanted = {self._key(a): a for a in assignments}
        for key, run in list(self.running.items()):
            if key not in wanted:
                run.successor = None
                self._terminate(run)
        for key, a in wanted.items():
            if key in self.running:
                self._update(self.running[key], a)
            elif key not in self.finished:
                self._start(a)
        self.finished &= set(wanted)

    def _spec(self, a: pb.Assignment) -> RoleSpec:
        keys = self.curve_keys if self.curve else None  # none: the data plane is plaintext
        return RoleSpec(
            coordinator=self.config.coordinator, node_id=self.node_id, address=self.address,
            experiment_id=a.experiment_id, index=a.index, experiment_json=a.experiment_json,
            checkpoint_dir=self._checkpoint_dir(a), node_name=self.name, threads=self.config.threads_per_role,
            metrics_socket=self.metrics.socket_path if self.metrics else "",
            log_level=self.config.log_level, log_format=self.config.log_format,
            security=self.config.security.spec() if self.config.security else None,
            curve_public=keys.public if keys else "", curve_secret=keys.secret if keys else "",
            assignment=self._update_of(a), lease_until=self.lease_until, workdir=self.workdirs.path(workdir_of(a)),
        )

    def _checkpoint_dir(self, a: pb.Assignment) -> str:
        """Where `a`'s role writes checkpoints; the file server lends what lies there to restoring shards."""
        path = self.config.checkpoint_dir or a.checkpoint_dir
        self.files.add_root(path)
        return path

    @staticmethod
    def _update_of(a: pb.Assignment) -> AssignmentUpdate:
        """What a running role process learns of a changed assignment."""
        return AssignmentUpdate(
            lead=a.lead, num_workers=a.num_workers, endpoints={int(k): v for k, v in a.shard_endpoints.items()},
            generation=a.generation, worker_rank=a.worker_rank, replica=a.replica,
            backup_endpoint=a.backup_endpoint, workers=tuple(a.workers), restore_epoch=a.restore_epoch,
            peers={int(k): v for k, v in a.peer_endpoints.items()},
            curve_server_keys=dict(a.curve_server_keys), curve_members=tuple(a.curve_members),
            shard_epochs={int(k): int(v) for k, v in a.shard_epochs.items()}, sender_token=a.sender_token,
            sender_key=a.sender_key, curve_senders=dict(a.curve_senders),
            checkpoint_sources=dict(a.checkpoint_sources),
        )

    def _start(self, a: pb.Assignment) -> None:
        from gossamer.node import roles

        spec = self._spec(a)
        procs: list[RoleProcess] = []
        pipes: list[RolePipe] = []
        hold: socket.socket | None = None
        if a.role == pb.ROLE_PARAMETER_SERVER:
            spec = replace(spec, label=f"ps{a.index}" + ("b" if a.replica else ""),
                           log_file=str(self.role_logs.path(a.experiment_id, log_stem(worker=False, index=a.index,
                                                                                        replica=a.replica))))
            recv, send = self._roles.Pipe(duplex=False)
            procs.append(self._roles.Process(target=roles.run_server, args=(spec, recv), name=f"gossamer-ps{a.index}"))
            pipes.append(send)
        else:
            nproc = self.config.nproc_per_node
            hold = reserve_port() if nproc > 1 else None
            port = hold.getsockname()[1] if hold is not None else 0
            for rank in range(nproc):
                rspec = replace(spec, local_rank=rank, nproc=nproc, master_port=port, label=f"w{a.index}.{rank}",
                                log_file=str(self.role_logs.path(a.experiment_id, log_stem(worker=True, index=a.index,
                                                                                             local_rank=rank))))
                if rank > 0 and self.attached is not None:  # runs in the launcher's process of that local rank
                    proc, pipe = self.attached.remote(rank, rspec)
                    procs.append(proc)
                    pipes.append(pipe)
                    continue
                recv, send = self._roles.Pipe(duplex=False)
                procs.append(self._roles.Process(target=roles.run_worker_rank, args=(rspec, recv),
                                            name=f"gossamer-w{a.index}.{rank}"))
                pipes.append(send)
        for p in procs:
            p.start()
        log.info("started %s %d of %s (%d process%s)", "shard" if a.role == pb.ROLE_PARAMETER_SERVER else "worker",
                 a.index, a.experiment_id, len(procs), "es" if len(procs) > 1 else "")
        self.running[self._key(a)] = _Running(procs, pipes, a, port_hold=hold)

    def _update(self, run: _Running, a: pb.Assignment) -> None:
        if run.successor is not None or (a.role == pb.ROLE_PARAMETER_SERVER and a.replica > run.assignment.replica):
            # A shard process never becomes a backup again: this is a new backup in place of a
            # primary that failed here; it starts in a new process once the old one is gone.
            run.successor = a
            self._terminate(run)
            return
        if a.SerializeToString(deterministic=True) == run.assignment.SerializeToString(deterministic=True):
            return
        run.assignment = a
        self._tell(run, self._update_of(a))

    @staticmethod
    def _tell(run: _Running, msg: AssignmentUpdate | LeaseRenewal | ShardStop) -> None:
        """Send `msg` to each of `run`'s processes (one that is gone is past hearing it)."""
        for pipe in run.pipes:
            try:
                pipe.send(msg)
            except (BrokenPipeError, OSError):
                pass

    def _terminate(self, run: _Running) -> None:
        run.stopping = True
        if run.assignment.role == pb.ROLE_PARAMETER_SERVER:
            self._tell(run, ShardStop())  # the SIGTERM is the agent's: a shard heeds it
        for p in run.procs:
            if p.is_alive():
                p.terminate()  # SIGTERM; an attached rank passes it on to its child

    async def _stop_runs(self, runs: dict[tuple[str, int, int], _Running], grace: float) -> None:
        for run in runs.values():
            self._terminate(run)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.is_alive() for r in runs.values() for p in r.procs):
            await asyncio.sleep(0.05)
        for key, run in runs.items():
            for p in run.procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=1)
            run.forget()
            self.running.pop(key, None)

    async def _monitor(self) -> None:
        """Reap role processes; report a crash to the coordinator; stop a worker's other ranks."""
        while True:
            await asyncio.sleep(0.2)
            for key, run in list(self.running.items()):
                codes = [p.exitcode for p in run.procs]
                if all(c is None for c in codes):
                    continue
                failed = [c for c in codes if c not in (None, 0)]
                if failed and not run.stopping and not run.reported:
                    run.reported = True
                    run.failed_at = time.monotonic()
                    if failed[0] != EXIT_REPORTED:  # else the process told the coordinator why itself
                        await self._report_failure(run, failed[0])
                    self._terminate(run)
                elif run.failed_at and time.monotonic() - run.failed_at > 5.0:
                    # A sibling rank stuck in a collective with the dead one ignores SIGTERM.
                    for p in run.procs:
                        if p.is_alive():
                            p.kill()
                if all(c is not None for c in codes):
                    run.forget()
                    del self.running[key]
                    if run.successor is not None:
                        self._start(run.successor)
                    elif not run.stopping and not failed:  # a failed role starts again if assigned again
                        self.finished.add(key)
            if self.attached is not None and self.attached.lost and not self._stop.is_set():
                # Its launcher process is gone: this node can no longer run the ranks it advertised.
                log.error("local rank(s) %s of %s are gone: leaving", self.attached.lost, self.config.launch.source)
                self.exit_code, self._reason = 1, "local rank lost"
                self._stop.set()

    async def _report_failure(self, run: _Running, code: int) -> None:
        a = run.assignment
        assert self._stub is not None
        msg = f"role process exited with code {code}"
        if self.metrics is not None:
            self.metrics.role_failed()
        log.error("%s %d of %s: %s", pb.Role.Name(a.role), a.index, a.experiment_id, msg)
        try:
            await self._stub.ReportRole(
                pb.ReportRoleRequest(node_id=self.node_id, experiment_id=a.experiment_id, role=a.role,
                                     index=a.index, state=pb.ROLE_STATE_FAILED, message=msg),
                timeout=5.0,
            )
        except grpc.RpcError:
            pass


def _alive(p: RoleProcess) -> bool:
    """Whether `p` runs, asked of the process itself where `is_alive` may not know.

    A role forked by the fork server looks gone to `is_alive` once that server has exited, and a
    batch job's end signals the fork server along with everything else.
    """
    if p.is_alive():
        return True
    pid = getattr(p, "pid", None)
    return pid is not None and pid != 0 and pid_alive(pid)


def _curve_keypair() -> CurveKeyPair | None:
    """A fresh CURVE key pair, or None where libzmq lacks CURVE (a coordinator running with
    CURVE then refuses the join, naming the missing key)."""
    try:
        return CurveKeyPair.generate()
    except ConfigError:
        log.warning("this libzmq has no CURVE support: the node can only join a plaintext data plane")
        return None


def parse_labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError("labels", f"expected key=value, got {item!r}")
        out[k] = v
    return out
