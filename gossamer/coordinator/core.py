"""The coordinator's state and logic: membership, experiments, role assignment and recovery (server.py serves it)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Protocol

from gossamer.coordinator import failover, final_reports, placement, views
from gossamer.coordinator.beat_rate import BeatRate, renew
from gossamer.coordinator.blind_time import BlindTime
from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.import_checks import ImportChecker
from gossamer.coordinator.records import ExpRec, NodeRec, RoleRec, check_node_id, checkpoint_server
from gossamer.coordinator.store import Store
from gossamer.coordinator.stragglers import StepRates, worker_speeds
from gossamer.coordinator.streams import AssignmentStreams
from gossamer.core.errors import ConfigError, NotFoundError
from gossamer.core.experiment import Experiment
from gossamer.core.faults import hold_at
from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)


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
    """All coordinator state and logic; the servicers in server.py are thin RPC adapters over it."""

    #: The gRPC server serving this state: /metrics shows its restart and refusal counts.
    grpc_server: ServingCounts | None = None

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
        self._seq = max((e.seq for e in exps), default=0)
        self._changed = asyncio.Event()  # replaced by a fresh one at every change
        self.streams = AssignmentStreams()
        self.beat_rate = BeatRate(interval_s=config.heartbeat_interval_s, window_s=config.lease_timeout_s)
        self._behind = False
        self.blind = BlindTime(tick_s=min(0.5, config.heartbeat_interval_s), keep_s=2 * config.lease_timeout_s + 1, start=now)
        self.import_checker = ImportChecker(config.import_check_concurrency, timeout_s=config.import_check_timeout_s)
        self.curve = config.data_plane_curve
        if self.curve:
            import zmq  # not at import time: a plaintext coordinator never loads ZMQ

            if not zmq.has("curve"):
                raise ConfigError("curve", "this pyzmq/libzmq was built without CURVE support")
        self._source_steps: dict[tuple[str, str], int] = {}  # (experiment, metric source) -> last step reported
        self.step_rates = StepRates()  # per-node step rates from workers' reports (stragglers)
        self.suspicion = failover.ShardSuspicion()  # shards their workers time out on
        if nodes or exps:
            log.info("resumed state: %d nodes, %d experiments", len(nodes), len(exps))

    # --- change notification ---------------------------------------------------------------
    # An Event swapped at each change, not a Condition: on Python 3.11 a Condition.wait()
    # cancelled by wait_for at shutdown can leave its lock released, and `async with` then
    # raised "Lock is not acquired" in every stream handler, so SIGTERM did not end the process.
    async def _notify(self, *, assignments: bool = True, only: ExpRec | None = None) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if only is not None:  # a change inside one experiment that took no role from anyone (a role's report)
            self.streams.wake_exactly(r.node_id for r in only.roles)
        elif assignments:
            self.streams.wake(r.node_id for exp in self.exps.values() if exp.active for r in exp.roles)

    async def wait_change(self, timeout: float) -> None:
        await wait_event(self._changed, timeout)

    # --- membership ------------------------------------------------------------------------
    async def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        hold_at("join")  # a stalled coordinator that serves a Join after its sender gave up on it (tests)
        now = time.time()
        curve_key = _curve_key(req, self.curve)
        node = self.nodes.get(check_node_id(req.node_id)) if req.node_id else None
        if node is not None and node.alive:
            node.last_seen = now
            node.curve_key = curve_key  # the same key after a coordinator restart; assignments follow a new one
            node.checkpoint_endpoint, node.checkpoint_secret, node.checkpoint_key = checkpoint_server(req)
            kind, what = "rejoin", f"node {node.name} re-attached"
        else:
            node = NodeRec.from_join(req, req.node_id or uuid.uuid4().hex[:12], now, curve_key)
            self.nodes[node.id] = node
            kind, what = "join", f"node {node.name} joined ({'spot' if node.spot else 'on-demand'})"
        # One transaction, shared with the joins that arrive meanwhile (group_commit.py); answered once committed.
        await asyncio.gather(self.store.add_event(kind, what, node_id=node.id), self.store.save_node(node))
        await self.reconcile(changed=kind == "rejoin")  # a new node is in no one's assignments; a re-attach may be
        return pb.JoinResponse(
            node_id=node.id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            lease_timeout_s=self.config.lease_timeout_s,
            curve=self.curve,
        )

    async def heartbeat(self, node_id: str) -> bool:
        return renew(self.nodes.get(node_id), self.beat_rate)  # UDP beats renew the same way (udp_beats.py)

    async def leave(self, node_id: str, reason: str) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFoundError(f"node {node_id} is not known")
        if not node.alive:
            return
        await self._remove_node(node, pb.NODE_STATE_LEFT, f"left: {reason or 'no reason given'}")

    def stream_changed(self, node_id: str, *, is_open: bool) -> None:
        """A node's assignment stream opened or closed (a closed one is evidence for the reaper)."""
        (self.streams.opened if is_open else self.streams.closed)(node_id)
        node = self.nodes.get(node_id)
        if node is not None and (is_open or node.alive):
            node.stream_lost_at = 0.0 if is_open else time.time()

    async def reap_leases(self, lag_s: float = 0.0, *, sweep: bool = False) -> None:
        """Declare nodes lost whose lease expired or whose stream dropped with no heartbeat since.

        While the coordinator is starved or backlogged (`BeatRate.behind`; `lag_s`: how late
        this tick is), no lease expires: the silence is its own. A closed stream still counts at
        once; a node cut off without its connection closing is caught once keepalive closes it.
        """
        now = time.time()
        if sweep and (late := self.blind.sweep(now)) >= 0.5 * self.config.lease_timeout_s:
            log.warning("lease sweep %.1fs late (the coordinator was not scheduled): not counted against leases", late)
        lease = self.config.lease_timeout_s
        connected, suspects = failover.lease_suspects(self.nodes.values(), now=now, lease_timeout_s=lease,
                                                      is_open=self.streams.is_open)
        behind = self.beat_rate.behind(now, connected, lag_s)
        if behind != self._behind:
            self._behind = behind
            log.warning("coordinator %s", "behind its heartbeats: leases held"
                        if behind else "caught up with its heartbeats: leases expire again")
        for node in suspects:
            verdict = failover.lease_verdict(node, now=now, lease_timeout_s=math.inf if behind else lease,
                                             heartbeat_interval_s=self.config.heartbeat_interval_s, blind_since=self.blind.since)
            if verdict is not None:
                why, silent = verdict
                await self._remove_node(node, pb.NODE_STATE_LOST, why, silent)

    async def _remove_node(self, node: NodeRec, state: pb.NodeState.ValueType, why: str,
                           detect_s: float | None = None) -> None:
        node.state = state
        exp_id, node.experiment_id = node.experiment_id, ""
        kind = "lost" if state == pb.NODE_STATE_LOST else "leave"
        # Saved before any other await: retention may forget the node meanwhile, and a save after
        # its delete (the store runs them in order) brought a forgotten node back at the next start.
        await self.store.save_node(node)
        await self.store.add_event(kind, f"node {node.name} {why}", experiment_id=exp_id, node_id=node.id)
        exp = self.exps.get(exp_id)
        if exp is not None and exp.active:
            figures = {"nodes_lost" if kind == "lost" else "nodes_left": 1.0}
            if detect_s is not None:
                figures["detect_s"] = detect_s
            await self._recovery_metric(exp, figures)
            await self._node_gone(exp, node)
        await self.reconcile(changed=exp is not None and exp.active)  # a node without roles changes no stream's

    async def _recovery_metric(self, exp: ExpRec, add: dict[str, float]) -> None:
        await self.store.add_metrics(exp.id, [exp.add_recovery(add, time.time())])

    async def _node_gone(self, exp: ExpRec, node: NodeRec) -> None:
        """Every role `node` had in `exp` is gone: re-plan them."""
        mine = [r for r in exp.roles if r.node_id == node.id]
        exp.roles = [r for r in exp.roles if r.node_id != node.id]
        for r in mine:  # with the removal, before any await: a Complete in between must see one or the other
            final_reports.ended(exp, r)
        exp.generation += 1
        for r in failover.replacement_order(mine):
            await self._replace_role(exp, r, node.name)
        exp.lead_node = placement.lead_node(exp.roles)
        await self.store.save_experiment(exp)

    async def _drop_role(self, exp: ExpRec, role: RoleRec, why: str) -> None:
        """One role process failed on a node that lives on: re-plan just that role."""
        exp.roles = [r for r in exp.roles if r is not role]
        final_reports.ended(exp, role)  # with the removal, before any await (as in _node_gone)
        exp.generation += 1
        node = self.nodes.get(role.node_id)
        await self.store.add_event("lost", why, experiment_id=exp.id, node_id=role.node_id)
        await self._release_if_idle(exp, role.node_id)
        await self._replace_role(exp, role, node.name if node else role.node_id)
        exp.lead_node = placement.lead_node(exp.roles)
        await self.store.save_experiment(exp)

    async def _replace_role(self, exp: ExpRec, r: RoleRec, where: str) -> None:
        recovery = failover.recovery_for(r, exp.roles)
        if isinstance(recovery, failover.DropWorker):
            left = len(exp.roles_of(pb.ROLE_WORKER))
            await self.store.add_event(
                "reassign", f"worker {r.index} on {where} removed; {left} worker(s) remain "
                f"(generation {exp.generation})", experiment_id=exp.id, node_id=r.node_id,
            )
            return
        if isinstance(recovery, failover.RestoreShard):
            await self._restore_shard(exp, r.index, where, recovery.stale)
            return
        if isinstance(recovery, failover.ReplaceBackup):
            await self.store.add_event("reassign", f"backup of shard {r.index} on {where} lost",
                                       experiment_id=exp.id, node_id=r.node_id)
            for x in recovery.unreplicated:
                x.replicated = False
        else:
            backup = recovery.backup
            backup.replica = 0
            backup.replicated = False
            epoch = exp.next_epoch(r.index)
            await self._recovery_metric(exp, {"promotions": 1.0})
            await self.store.add_event(
                "promote", f"shard {r.index}: primary on {where} gone; backup on "
                f"{self._name(backup.node_id)} promoted ({backup.endpoint}) at epoch {epoch}",
                experiment_id=exp.id, node_id=backup.node_id,
            )
        await self._place_backup(exp, r.index)

    async def _restore_shard(self, exp: ExpRec, index: int, where: str, stale: tuple[RoleRec, ...]) -> None:
        """Every usable replica of shard `index` is gone: a new primary loads the checkpoint (no host: it waits, `_resume`)."""
        exp.roles = [x for x in exp.roles if x not in stale]  # an unsynced backup cannot serve
        for x in stale:
            await self._release_if_idle(exp, x.node_id)
        host = placement.shard_host(exp.roles, index, self.nodes, placement.free_nodes(self.nodes.values()))
        why = f"every replica gone (last on {where})"
        if host is None:
            await self.store.add_event("restore", f"shard {index}: {why}; no node can host it yet",
                                       experiment_id=exp.id)
            return
        await self._place_restore(exp, index, host, why)

    async def _place_restore(self, exp: ExpRec, index: int, host: NodeRec, why: str) -> None:
        """A new primary of shard `index` on `host` restores the newest good checkpoint."""
        exp.restore_epoch += 1
        targets = failover.roll_back_together(exp.roles, index, barrier=exp.mode.barrier)
        for x in exp.roles:
            if x.role == pb.ROLE_PARAMETER_SERVER and x.index in targets:
                x.restore_epoch = exp.restore_epoch
        for shard in targets:
            exp.next_epoch(shard)
        self._bind(exp, host, pb.ROLE_PARAMETER_SERVER, index)
        exp.roles[-1].restore_epoch = exp.restore_epoch
        await self._recovery_metric(exp, {"restores": 1.0})
        await self.store.add_event(
            "restore", f"shard {index}: {why}; restoring from the newest good "
            f"checkpoint on {host.name}" + (f"; shards {targets} roll back with it" if len(targets) > 1 else ""),
            experiment_id=exp.id, node_id=host.id,
        )
        await self._place_backup(exp, index)

    async def _release_if_idle(self, exp: ExpRec, node_id: str) -> None:
        """A node left with no role in `exp` is free for other work again."""
        node = self.nodes.get(node_id)
        if node is None or node.experiment_id != exp.id or any(r.node_id == node_id for r in exp.roles):
            return
        node.experiment_id = ""
        if node.alive:
            node.state = pb.NODE_STATE_READY
        await self.store.save_node(node)

    async def _place_backup(self, exp: ExpRec, index: int) -> None:
        if not exp.spec.get("ps_backup", True) or not exp.active:
            return
        host = placement.shard_host(exp.roles, index, self.nodes, placement.free_nodes(self.nodes.values()))
        if host is None:
            await self.store.add_event("degraded", f"shard {index} runs without a backup: no other node",
                                       experiment_id=exp.id)
            return
        self._bind(exp, host, pb.ROLE_PARAMETER_SERVER, index)
        exp.roles[-1].replica = 1
        await self.store.add_event("reassign", f"backup of shard {index} placed on {host.name}",
                                   experiment_id=exp.id, node_id=host.id)

    def _name(self, node_id: str) -> str:
        node = self.nodes.get(node_id)
        return node.name if node else node_id

    # --- scheduling ------------------------------------------------------------------------
    async def reconcile(self, *, changed: bool = True) -> None:
        """Start queued experiments and grow running async ones with free nodes; wake the assignment streams
        if that changed any (or the caller did: `changed`; a join changed none, and waking every stream with
        roles at every join of a storm cost 90 ms a join at 100 experiments)."""
        head = ""  # the first queued experiment that could not start: later ones wait behind it (FIFO)
        census: placement.Census | None = None  # nodes listed once, again only after an experiment took some
        for exp in sorted(self.exps.values(), key=lambda e: e.seq):
            if not exp.active:
                continue
            census = census or placement.Census.of(self.nodes.values())
            free = census.free
            if exp.state == pb.EXPERIMENT_STATE_QUEUED:
                plan = None if head else placement.place_experiment(free, exp.spec, exp.mode)
                if plan is None:
                    self._say_why_queued(exp, head, census)
                    head = head or exp.id
                    continue
                exp.message = ""
                await self._start(exp, plan)
            # Behind a queued head a running experiment takes no free node (FIFO), as before.
            elif exp.state != pb.EXPERIMENT_STATE_RUNNING or not await self._resume(exp, [] if head else free):
                continue
            census, changed = None, True
            await self.store.save_experiment(exp)
            for r in exp.roles:
                await self.store.save_node(self.nodes[r.node_id])
        await self._notify(assignments=changed)

    def _say_why_queued(self, exp: ExpRec, head: str, census: placement.Census) -> None:
        """Set a queued experiment's message to what it waits for; not saved (a leader derives it again): it
        counts nodes, and saving it wrote every queued experiment at every join (31 % of the CPU)."""
        exp.message = placement.queued_message(census, exp.spec, exp.mode, head)

    async def _start(self, exp: ExpRec, plan: placement.Placement) -> None:
        """Bind a queued experiment's roles as `plan` says; it runs once every shard serves."""
        exp.state = pb.EXPERIMENT_STATE_STARTING
        exp.starting_unix = time.time()
        exp.generation += 1
        for i, n in enumerate(plan.servers):
            self._bind(exp, n, pb.ROLE_PARAMETER_SERVER, i)
        for n in plan.workers:
            self._bind(exp, n, pb.ROLE_WORKER, exp.next_worker_index)
            exp.next_worker_index += 1
        for i in range(len(plan.servers)):
            await self._place_backup(exp, i)
        exp.lead_node = placement.lead_node(exp.roles)
        serverless = not exp.mode.servers
        await self.store.add_event(
            "schedule",
            (f"{len(plan.servers)} shard(s) on {', '.join(n.name for n in plan.servers)}; "
             if not serverless else "no parameter servers (gossip); ")
            + f"workers on {', '.join(n.name for n in plan.workers)}",
            experiment_id=exp.id,
        )
        if serverless:  # nothing to wait for: the workers find each other
            await self._running(exp, "gossip workers starting")

    async def _resume(self, exp: ExpRec, free: list[NodeRec]) -> bool:
        """Free nodes host the shards a running experiment lost, then its workers; it says what it waits for (changed?)."""
        generation, waiting, said = exp.generation, exp.waiting_unix, exp.message
        for index in placement.missing_shards(exp.roles, exp.spec["num_ps_shards"] if exp.mode.servers else 0):
            host = placement.shard_host(exp.roles, index, self.nodes, free)
            if host is None:
                break
            await self._place_restore(exp, index, host, "nodes returned")
            exp.generation += 1
            free = placement.free_nodes(self.nodes.values())
        if free:
            await self._grow(exp, free)
        exp.lead_node = placement.lead_node(exp.roles)
        what = placement.waiting_for(exp.roles, exp.spec["num_ps_shards"] if exp.mode.servers else 0)
        # Losses seen one at a time widen the wait: say each change (the deadline runs from the first).
        if what and (message := f"waiting for {what}; fails unless one comes within "
                                f"{exp.spec['node_wait_timeout_s']:g} s (node_wait_timeout_s)") != exp.message:
            exp.waiting_unix, exp.message = exp.waiting_unix or time.time(), message
            await self.store.add_event("waiting", exp.message, experiment_id=exp.id)
        elif not what and exp.waiting_unix:
            exp.waiting_unix, exp.message, exp.progress_unix, exp.stalled = 0.0, "", time.time(), False
            await self.store.add_event("resumed", "nodes returned: every shard has a host and a worker runs",
                                       experiment_id=exp.id)
        return exp.generation != generation or exp.waiting_unix != waiting or exp.message != said

    async def _grow(self, exp: ExpRec, free: list[NodeRec]) -> None:
        """Free nodes join a running experiment as workers (up to its max_workers)."""
        current = len(exp.roles_of(pb.ROLE_WORKER))
        added = placement.grow(free, current_workers=current, max_workers=exp.spec["max_workers"])
        for n in added:
            self._bind(exp, n, pb.ROLE_WORKER, exp.next_worker_index)
            exp.next_worker_index += 1
            await self.store.add_event(
                "reassign", f"node {n.name} joins as worker {exp.next_worker_index - 1}",
                experiment_id=exp.id, node_id=n.id,
            )
        if added:
            exp.generation += 1
            exp.lead_node = placement.lead_node(exp.roles)

    async def _running(self, exp: ExpRec, message: str) -> None:
        exp.state = pb.EXPERIMENT_STATE_RUNNING
        exp.started_unix = exp.started_unix or time.time()
        exp.progress_unix = time.time()
        await self.store.add_event("running", message, experiment_id=exp.id)

    async def check_deadlines(self) -> None:
        """Act on overdue waits: a start, nodes that do not return, a run making no progress."""
        now = time.time()
        for exp in [e for e in self.exps.values() if e.active]:
            spec = exp.spec
            if exp.completing_unix:
                await self.settle_completion(exp)
            elif exp.state == pb.EXPERIMENT_STATE_STARTING:
                late = placement.start_overdue(exp.roles, spec["num_ps_shards"], since=exp.starting_unix, now=now,
                                               timeout_s=spec["start_timeout_s"])
                if late is not None:
                    await self._start_late(exp, late)
            elif exp.state != pb.EXPERIMENT_STATE_RUNNING:
                continue
            elif placement.overdue(exp.waiting_unix, now=now, timeout_s=spec["node_wait_timeout_s"]):
                await self._finish(exp, pb.EXPERIMENT_STATE_FAILED, f"no nodes came: {exp.message.partition(';')[0]} for "
                                   f"{spec['node_wait_timeout_s']:g} s (node_wait_timeout_s): giving up")
            elif not exp.waiting_unix and not exp.stalled and placement.overdue(
                    exp.progress_unix, now=now, timeout_s=spec["progress_timeout_s"]):
                exp.stalled = True
                exp.message = _stall_message(exp, now)
                await self.store.add_event("stalled", exp.message, experiment_id=exp.id)
                await self.store.save_experiment(exp)
                await self._notify()

    async def _start_late(self, exp: ExpRec, late: placement.StartOverdue) -> None:
        """STARTING is overdue: fail with the reason, or run without the backups that never synced."""
        if late.reason:
            await self._finish(exp, pb.EXPERIMENT_STATE_FAILED, late.reason)
            return
        exp.roles = [r for r in exp.roles if r not in late.backups]
        for b in late.backups:
            await self._release_if_idle(exp, b.node_id)
            await self.store.add_event("degraded", f"shard {b.index} runs without a backup: the backup on "
                                       f"{self._name(b.node_id)} did not sync within {exp.spec['start_timeout_s']:g} s "
                                       "(start_timeout_s)", experiment_id=exp.id, node_id=b.node_id)
        exp.generation += 1
        await self._running(exp, "all shards serving; started without the backups that did not sync")
        await self.store.save_experiment(exp)
        await self.reconcile()

    def _bind(self, exp: ExpRec, node: NodeRec, role: pb.Role.ValueType, index: int) -> None:
        node.experiment_id = exp.id
        node.state = pb.NODE_STATE_BUSY
        exp.roles.append(RoleRec(node_id=node.id, role=role, index=index, state=pb.ROLE_STATE_UNSPECIFIED))

    async def _finish(self, exp: ExpRec, state: pb.ExperimentState.ValueType, message: str) -> None:
        exp.state = state
        exp.message = message
        exp.finished_unix = time.time()
        self.step_rates.forget(exp.id)
        self.suspicion.forget(exp.id)
        self._source_steps = {k: v for k, v in self._source_steps.items() if k[0] != exp.id}
        for r in exp.roles:
            node = self.nodes.get(r.node_id)
            if node is not None and node.experiment_id == exp.id:
                node.experiment_id = ""
                if node.alive:
                    node.state = pb.NODE_STATE_READY
                await self.store.save_node(node)
        await self.store.save_experiment(exp)
        await self.store.add_event(pb.ExperimentState.Name(state).removeprefix("EXPERIMENT_STATE_").lower(),
                                   message, experiment_id=exp.id)
        await self.reconcile()

    def assignments_for(self, node_id: str) -> list[pb.Assignment]:
        node = self.nodes.get(node_id)
        if node is None or not node.experiment_id:
            return []
        exp = self.exps.get(node.experiment_id)
        if exp is None or not exp.active:
            return []
        keys = views.curve_keys(exp, self.nodes) if self.curve else ({}, [], {})
        return views.assignments(exp, node_id, checkpoint_root=self.checkpoint_root, curve_keys=keys,
                                 holders=views.checkpoint_holders(exp, self.nodes))

    # --- experiments -----------------------------------------------------------------------
    async def submit(self, experiment_json: str) -> str:
        exp = Experiment.from_json(experiment_json)
        checked = await self.import_checker.check(exp) if self.config.check_imports else True
        self._seq += 1
        rec = ExpRec(id=f"{_slug(exp.name)}-{uuid.uuid4().hex[:6]}", seq=self._seq, name=exp.name,
                     spec_json=exp.to_json(), created_unix=time.time())
        self.exps[rec.id] = rec
        await self.store.save_experiment(rec)
        await self.store.add_event("submit", f"experiment {rec.name} queued", experiment_id=rec.id)
        if not checked:
            await self.store.add_event("import_check", self.import_checker.unchecked_note(), experiment_id=rec.id)
        await self.reconcile()
        return rec.id

    def get(self, exp_id: str) -> ExpRec:
        exp = self.exps.get(exp_id)
        if exp is None:
            raise NotFoundError(f"experiment {exp_id!r} does not exist")
        return exp

    def status(self, exp: ExpRec) -> pb.ExperimentStatus:
        rates, slow = worker_speeds(self.step_rates, exp)
        return views.experiment_status(exp, self.nodes, rates, slow)

    async def cancel(self, exp_id: str) -> ExpRec:
        exp = self.get(exp_id)
        if exp.active:
            await self._finish(exp, pb.EXPERIMENT_STATE_CANCELLED, "cancelled by user")
        return exp

    async def report_role(self, req: pb.ReportRoleRequest) -> None:
        # protobuf enums are open: an unknown number would be stored and break every status
        if req.role not in pb.Role.values():
            raise ConfigError("role", f"unknown role {req.role}")
        if req.state not in pb.RoleState.values():
            raise ConfigError("state", f"unknown role state {req.state}")
        exp = self.get(req.experiment_id)
        role = next(
            (r for r in exp.roles if r.node_id == req.node_id and r.role == req.role and r.index == req.index),
            None,
        )
        if role is None or not exp.active:
            return  # a stale report from a role the coordinator already moved on from
        if (req.role == pb.ROLE_PARAMETER_SERVER and req.state != pb.ROLE_STATE_FAILED and req.replica != role.replica
                and role.restore_epoch and not role.endpoint):
            return  # a backup process not yet turned into the restored primary it now is
        role.state = req.state
        role.endpoint = req.endpoint or role.endpoint
        role.message = req.message
        node_name = self.nodes[req.node_id].name if req.node_id in self.nodes else req.node_id
        what = f"{pb.Role.Name(req.role).removeprefix('ROLE_').lower()} {req.index} on {node_name}"
        if req.state == pb.ROLE_STATE_FAILED:
            exp.failures += 1
            if why := failover.failure_ends(exp.user_failures, exp.failures, exp.spec["max_workers"], req):
                await self._finish(exp, pb.EXPERIMENT_STATE_FAILED, f"{what} failed: {req.message} ({why})")
                return
            workers = len(exp.roles_of(pb.ROLE_WORKER))
            await self._drop_role(exp, role, f"{what} failed: {req.message}")
            if req.role == pb.ROLE_WORKER:
                await self._suspect_shards(exp, role, req.message, workers)
            await self.reconcile()
            return
        if req.state == pb.ROLE_STATE_SERVING and req.message:  # e.g. a shard's checkpoint write failed
            await self.store.add_event("warning", f"{what}: {req.message}", experiment_id=exp.id,
                                       node_id=req.node_id)
        if req.role == pb.ROLE_WORKER and req.state == pb.ROLE_STATE_SERVING:
            await self.store.add_event("ready", f"{what} ready (model built, parameters pulled next)",
                                       experiment_id=exp.id, node_id=req.node_id)
        if req.role == pb.ROLE_PARAMETER_SERVER:
            await self._shard_reported(exp, role, req)
        if exp.state == pb.EXPERIMENT_STATE_STARTING and placement.shards_ready(exp.roles, exp.spec["num_ps_shards"]):
            servers = exp.roles_of(pb.ROLE_PARAMETER_SERVER)
            await self._running(exp, "all shards serving: " + ", ".join(r.endpoint for r in servers))
        await self.store.save_experiment(exp)
        await self._notify(only=exp)
        if exp.completing_unix and req.state == pb.ROLE_STATE_DONE:  # its final counters came just before
            await self.settle_completion(exp)

    async def _suspect_shards(self, exp: ExpRec, worker: RoleRec, message: str, workers: int) -> None:
        """Workers that time out on the same shard get its primary failed over, not themselves replaced in a loop."""
        for index in self.suspicion.timed_out(exp.id, f"{worker.node_id}:{worker.index}", message, time.time(),
                                              workers=workers):
            primary = next((r for r in exp.roles_of(pb.ROLE_PARAMETER_SERVER) if r.index == index and not r.replica),
                           None)
            if primary is not None:
                await self._drop_role(exp, primary, f"parameter_server {index} on {self._name(primary.node_id)} "
                                      f"suspected: its workers timed out on it ({message})")

    async def _shard_reported(self, exp: ExpRec, role: RoleRec, req: pb.ReportRoleRequest) -> None:
        """A shard's report: its backup attached or detached, it restored, its version."""
        if role.replica == 0 and req.replicated != role.replicated:
            role.replicated = req.replicated
            await self.store.add_event(
                "replicated" if req.replicated else "degraded",
                f"shard {req.index}: backup {'attached' if req.replicated else 'detached'} at version {req.version}",
                experiment_id=exp.id, node_id=req.node_id,
            )
        restore = failover.restore_outcome(exp.roles, role, index=req.index, version=int(req.version),
                                           source=req.restored_from,
                                           last=exp.shard_versions.get(str(req.index), 0),
                                           counted=int(req.versions_lost), unknown=req.versions_lost_unknown)
        if restore is not None:
            kind, message, lost = restore
            if kind == "restored":
                await self._recovery_metric(exp, {"versions_lost_min": float(lost)})
            await self.store.add_event(kind, message, experiment_id=exp.id, node_id=req.node_id)
            if kind == "restored" and lost and not req.version:  # never silently from initial values
                await self._finish(exp, pb.EXPERIMENT_STATE_FAILED, _no_source(exp, req.index, lost))
        role.version = int(req.version)

    async def report_metrics(self, req: pb.ReportMetricsRequest) -> bool:
        exp = self.get(req.experiment_id)
        for p in req.points:  # a NaN time broke the metrics table's NOT NULL and the ordering of points
            if not math.isfinite(p.time_unix):
                raise ConfigError("time_unix", f"a metric point needs a finite time, got {p.time_unix!r}")
        rows, steps = [], exp.steps
        for p in req.points:
            values = dict(p.values)
            rows.append((p.time_unix, p.step, p.source, values))
            for kind, message in exp.merge_point(p.source, p.time_unix, p.step, values):
                await self.store.add_event(kind, message, experiment_id=exp.id)  # nothing degrades silently
            # Progress: a source's step moved (after a roll-back the run's own count grows only once redone).
            if exp.active and p.step != self._source_steps.get((exp.id, p.source), -1):
                self._source_steps[(exp.id, p.source)] = p.step
                steps, exp.progress_unix = max(steps, p.step), time.time()
                if exp.stalled:
                    exp.stalled, exp.message = False, ""
                    await self.store.add_event("progress", f"steps again: step {p.step}", experiment_id=exp.id)
        self.step_rates.observe_points(exp.id, req.points)
        if rows:
            await self.store.add_metrics(exp.id, rows)
            steps = max(steps, exp.steps)  # shown once stored: a status said 200 steps, kill -9, the restart said 0
            await self.store.save_experiment(exp, steps=steps)
            exp.steps = max(steps, exp.steps)  # another source's report may have moved it meanwhile
            await self._notify(assignments=False)  # metrics never change a node's assignments
        return exp.active

    async def complete(self, req: pb.CompleteExperimentRequest) -> None:
        exp = self.get(req.experiment_id)
        if exp.active and final_reports.begin(exp, req, now=time.time()):
            await self.store.save_experiment(exp)
            await self.settle_completion(exp)

    async def settle_completion(self, exp: ExpRec) -> None:
        """Mark `exp` COMPLETED once every other worker's final counters are in, or given up on."""
        done = final_reports.settle(exp, now=time.time(), timeout_s=self.config.final_report_timeout_s,
                                    names={n.id: n.name for n in self.nodes.values()})
        if done is not None:
            if done.warning:
                await self.store.add_event("incomplete-metrics", done.warning, experiment_id=exp.id)
            await self._finish(exp, pb.EXPERIMENT_STATE_COMPLETED, done.message)

    # --- checkpoints -----------------------------------------------------------------------
    async def register_checkpoint(self, info: pb.CheckpointInfo) -> None:
        exp = self.get(info.experiment_id)
        await self.store.add_checkpoint(info.experiment_id, info.step, info.path, info.kind)
        if info.kind == "shard" and info.node_id in self.nodes:  # its disk holds it: a restore may fetch it there
            exp.checkpoint_holders[info.node_id] = max(exp.checkpoint_holders.get(info.node_id, 0), int(info.step))
            await self.store.save_experiment(exp)
        await self.store.add_event(
            "checkpoint", f"{info.kind} checkpoint at step {info.step}: {info.path}",
            experiment_id=info.experiment_id,
        )


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Wait for `event` at most `timeout` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass


def _curve_key(req: pb.JoinRequest, curve: bool) -> str:
    """The joining node's public CURVE key ("" when the data plane runs without CURVE)."""
    if not curve:
        return ""
    if not req.curve_public_key:
        raise ConfigError("curve_public_key", "this coordinator runs the data plane with CurveZMQ (--curve) "
                          "and the node sent no CURVE public key: upgrade gossamer on the node")
    from gossamer.security.curve import check_public_key

    return check_public_key(req.curve_public_key)


def _no_source(exp: ExpRec, index: int, lost: int) -> str:
    every = exp.spec["checkpoint_every"]
    return (f"shard {index} lost every replica, no checkpoint was found to restore it from (checkpoint_every "
            f"{every}{': none written yet' if every else ': none taken'}), and no worker held a newer copy of its "
            f"values than the initial ones; going on from its initial values would lose {lost} version(s): set "
            "checkpoint_every and keep ps_backup on to survive this")


def _stall_message(exp: ExpRec, now: float) -> str:
    spec = exp.spec
    return (f"no progress: no step reported for {now - exp.progress_unix:.0f} s (progress_timeout_s "
            f"{spec['progress_timeout_s']:g} s); still at step {exp.steps} of {spec['total_steps']}")


def _slug(name: str) -> str:
    s = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return (s or "exp")[:40]
