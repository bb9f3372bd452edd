"""The coordinator's recovery: what replaces a lost node's or failed process's roles, backups placed, shards restored."""

from __future__ import annotations

import time

from gossamer.coordinator import failover, final_reports, placement
from gossamer.coordinator.records import ExpRec, NodeRec, RoleRec
from gossamer.coordinator.state import CoordinatorState
from gossamer.v1 import coordinator_pb2 as pb


class Recovery:
    """Re-plans the roles an experiment lost as `failover.py` decides, and places backups and restoring primaries."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        self.store = state.store
        self.suspicion = failover.ShardSuspicion()  # shards their workers time out on
        state.on_forget(self.suspicion.forget)

    async def node_gone(self, exp: ExpRec, node: NodeRec) -> None:
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

    async def drop_role(self, exp: ExpRec, role: RoleRec, why: str) -> None:
        """One role process failed on a node that lives on: re-plan just that role."""
        exp.roles = [r for r in exp.roles if r is not role]
        final_reports.ended(exp, role)  # with the removal, before any await (as in node_gone)
        exp.generation += 1
        node = self.state.nodes.get(role.node_id)
        await self.store.add_event("lost", why, experiment_id=exp.id, node_id=role.node_id)
        await self.state.release_if_idle(exp, role.node_id)
        await self._replace_role(exp, role, node.name if node else role.node_id)
        exp.lead_node = placement.lead_node(exp.roles)
        await self.store.save_experiment(exp)

    async def suspect_shards(self, exp: ExpRec, worker: RoleRec, message: str, workers: int) -> None:
        """Workers that time out on the same shard get its primary failed over, not themselves replaced in a loop."""
        for index in self.suspicion.timed_out(exp.id, f"{worker.node_id}:{worker.index}", message, time.time(),
                                              workers=workers):
            primary = next((r for r in exp.roles_of(pb.ROLE_PARAMETER_SERVER) if r.index == index and not r.replica),
                           None)
            if primary is not None:
                await self.drop_role(exp, primary, f"parameter_server {index} on {self.state.name(primary.node_id)} "
                                     f"suspected: its workers timed out on it ({message})")

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
            await self.state.recovery_metric(exp, {"promotions": 1.0})
            await self.store.add_event(
                "promote", f"shard {r.index}: primary on {where} gone; backup on "
                f"{self.state.name(backup.node_id)} promoted ({backup.endpoint}) at epoch {epoch}",
                experiment_id=exp.id, node_id=backup.node_id,
            )
        await self.place_backup(exp, r.index)

    async def _restore_shard(self, exp: ExpRec, index: int, where: str, stale: tuple[RoleRec, ...]) -> None:
        """Every usable replica of shard `index` is gone: a new primary loads the checkpoint (no host: it waits, `Scheduler`)."""
        exp.roles = [x for x in exp.roles if x not in stale]  # an unsynced backup cannot serve
        for x in stale:
            await self.state.release_if_idle(exp, x.node_id)
        nodes = self.state.nodes
        host = placement.shard_host(exp.roles, index, nodes, placement.free_nodes(nodes.values()))
        why = f"every replica gone (last on {where})"
        if host is None:
            await self.store.add_event("restore", f"shard {index}: {why}; no node can host it yet",
                                       experiment_id=exp.id)
            return
        await self.place_restore(exp, index, host, why)

    async def place_restore(self, exp: ExpRec, index: int, host: NodeRec, why: str) -> None:
        """A new primary of shard `index` on `host` restores the newest good checkpoint."""
        exp.restore_epoch += 1
        targets = failover.roll_back_together(exp.roles, index, barrier=exp.mode.barrier)
        for x in exp.roles:
            if x.role == pb.ROLE_PARAMETER_SERVER and x.index in targets:
                x.restore_epoch = exp.restore_epoch
        for shard in targets:
            exp.next_epoch(shard)
        self.state.bind(exp, host, pb.ROLE_PARAMETER_SERVER, index)
        exp.roles[-1].restore_epoch = exp.restore_epoch
        await self.state.recovery_metric(exp, {"restores": 1.0})
        await self.store.add_event(
            "restore", f"shard {index}: {why}; restoring from the newest good "
            f"checkpoint on {host.name}" + (f"; shards {targets} roll back with it" if len(targets) > 1 else ""),
            experiment_id=exp.id, node_id=host.id,
        )
        await self.place_backup(exp, index)

    async def place_backup(self, exp: ExpRec, index: int) -> None:
        if not exp.spec.get("ps_backup", True) or not exp.active:
            return
        nodes = self.state.nodes
        host = placement.shard_host(exp.roles, index, nodes, placement.free_nodes(nodes.values()))
        if host is None:
            await self.store.add_event("degraded", f"shard {index} runs without a backup: no other node",
                                       experiment_id=exp.id)
            return
        self.state.bind(exp, host, pb.ROLE_PARAMETER_SERVER, index)
        exp.roles[-1].replica = 1
        await self.store.add_event("reassign", f"backup of shard {index} placed on {host.name}",
                                   experiment_id=exp.id, node_id=host.id)
