"""The coordinator's scheduling: queued experiments start on free nodes, running ones grow or wait, ended ones free theirs."""

from __future__ import annotations

import time

from gossamer.coordinator import placement
from gossamer.coordinator.records import ExpRec, NodeRec
from gossamer.coordinator.recovery import Recovery
from gossamer.coordinator.state import CoordinatorState
from gossamer.v1 import coordinator_pb2 as pb


class Scheduler:
    """Binds experiments' roles to nodes as `placement.py` decides, and moves experiments between states."""

    def __init__(self, state: CoordinatorState, recovery: Recovery) -> None:
        self.state = state
        self.store = state.store
        self.recovery = recovery

    async def reconcile(self, *, changed: bool = True) -> None:
        """Start queued experiments and grow running async ones with free nodes; wake the assignment streams
        if that changed any (or the caller did: `changed`; a join changed none, and waking every stream with
        roles at every join of a storm cost 90 ms a join at 100 experiments)."""
        head = ""  # the first queued experiment that could not start: later ones wait behind it (FIFO)
        census: placement.Census | None = None  # nodes listed once, again only after an experiment took some
        for exp in sorted(self.state.exps.values(), key=lambda e: e.seq):
            if not exp.active:
                continue
            census = census or placement.Census.of(self.state.nodes.values())
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
                await self.store.save_node(self.state.nodes[r.node_id])
        await self.state.notify(assignments=changed)

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
            self.state.bind(exp, n, pb.ROLE_PARAMETER_SERVER, i)
        for n in plan.workers:
            self.state.bind(exp, n, pb.ROLE_WORKER, exp.next_worker_index)
            exp.next_worker_index += 1
        for i in range(len(plan.servers)):
            await self.recovery.place_backup(exp, i)
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
            await self.running(exp, "gossip workers starting")

    async def _resume(self, exp: ExpRec, free: list[NodeRec]) -> bool:
        """Free nodes host the shards a running experiment lost, then its workers; it says what it waits for (changed?)."""
        generation, waiting, said = exp.generation, exp.waiting_unix, exp.message
        for index in placement.missing_shards(exp.roles, exp.spec["num_ps_shards"] if exp.mode.servers else 0):
            host = placement.shard_host(exp.roles, index, self.state.nodes, free)
            if host is None:
                break
            await self.recovery.place_restore(exp, index, host, "nodes returned")
            exp.generation += 1
            free = placement.free_nodes(self.state.nodes.values())
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
            self.state.bind(exp, n, pb.ROLE_WORKER, exp.next_worker_index)
            exp.next_worker_index += 1
            await self.store.add_event(
                "reassign", f"node {n.name} joins as worker {exp.next_worker_index - 1}",
                experiment_id=exp.id, node_id=n.id,
            )
        if added:
            exp.generation += 1
            exp.lead_node = placement.lead_node(exp.roles)

    async def running(self, exp: ExpRec, message: str) -> None:
        exp.state = pb.EXPERIMENT_STATE_RUNNING
        exp.started_unix = exp.started_unix or time.time()
        exp.progress_unix = time.time()
        await self.store.add_event("running", message, experiment_id=exp.id)

    async def start_late(self, exp: ExpRec, late: placement.StartOverdue) -> None:
        """STARTING is overdue: fail with the reason, or run without the backups that never synced."""
        if late.reason:
            await self.finish(exp, pb.EXPERIMENT_STATE_FAILED, late.reason)
            return
        exp.roles = [r for r in exp.roles if r not in late.backups]
        for b in late.backups:
            await self.state.release_if_idle(exp, b.node_id)
            await self.store.add_event("degraded", f"shard {b.index} runs without a backup: the backup on "
                                       f"{self.state.name(b.node_id)} did not sync within "
                                       f"{exp.spec['start_timeout_s']:g} s (start_timeout_s)",
                                       experiment_id=exp.id, node_id=b.node_id)
        exp.generation += 1
        await self.running(exp, "all shards serving; started without the backups that did not sync")
        await self.store.save_experiment(exp)
        await self.reconcile()

    async def finish(self, exp: ExpRec, state: pb.ExperimentState.ValueType, message: str) -> None:
        exp.state = state
        exp.message = message
        exp.finished_unix = time.time()
        self.state.forget(exp.id)
        for r in exp.roles:
            node = self.state.nodes.get(r.node_id)
            if node is not None and node.experiment_id == exp.id:
                node.experiment_id = ""
                if node.alive:
                    node.state = pb.NODE_STATE_READY
                await self.store.save_node(node)
        await self.store.save_experiment(exp)
        await self.store.add_event(pb.ExperimentState.Name(state).removeprefix("EXPERIMENT_STATE_").lower(),
                                   message, experiment_id=exp.id)
        await self.reconcile()
