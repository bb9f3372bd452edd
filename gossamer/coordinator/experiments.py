"""The coordinator's experiments: submit, cancel, status, roles' and metrics' reports, deadlines and completion."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from gossamer.coordinator import failover, final_reports, placement, views
from gossamer.coordinator.import_checks import ImportChecker
from gossamer.coordinator.records import ExpRec, RoleRec
from gossamer.coordinator.recovery import Recovery
from gossamer.coordinator.scheduling import Scheduler
from gossamer.coordinator.state import CoordinatorState
from gossamer.coordinator.stragglers import StepRates, worker_speeds
from gossamer.coordinator.workdirs import WorkdirStore
from gossamer.core.errors import ConfigError, NotFoundError
from gossamer.core.experiment import Experiment
from gossamer.v1 import coordinator_pb2 as pb


class Experiments:
    """An experiment from submit to its end: what its roles and metrics report, and the deadlines it must keep."""

    def __init__(self, state: CoordinatorState, recovery: Recovery, scheduler: Scheduler) -> None:
        self.state = state
        self.store = state.store
        self.recovery = recovery
        self.scheduler = scheduler
        config = state.config
        self.import_checker = ImportChecker(config.import_check_concurrency, timeout_s=config.import_check_timeout_s)
        self.workdirs = WorkdirStore(Path(config.state_dir) / "workdirs", max_bytes=config.workdir_max_bytes,
                                     total_bytes=config.workdir_store_bytes, in_use=self._workdirs_in_use)
        self._source_steps: dict[tuple[str, str], int] = {}  # (experiment, metric source) -> last step reported
        self.step_rates = StepRates()  # per-node step rates from workers' reports (stragglers)
        state.on_forget(self._forget)

    def _forget(self, exp_id: str) -> None:
        self.step_rates.forget(exp_id)
        self._source_steps = {k: v for k, v in self._source_steps.items() if k[0] != exp_id}

    def _workdirs_in_use(self) -> set[str]:
        return {w for e in self.state.exps.values() if e.active and (w := e.spec.get("workdir", ""))}

    async def submit(self, experiment_json: str) -> str:
        exp = Experiment.from_json(experiment_json)
        if exp.workdir and not self.workdirs.has(exp.workdir):
            raise ConfigError("workdir", f"{exp.workdir} is not stored on this coordinator: submit with --workdir DIR")
        checked = True
        if self.state.config.check_imports:
            # Imported with the shipped files first on the path, as every role will.
            code = str(await self.workdirs.unpacked(exp.workdir)) if exp.workdir else ""
            checked = await self.import_checker.check(exp, code)
        self.state.seq += 1
        rec = ExpRec(id=f"{_slug(exp.name)}-{uuid.uuid4().hex[:6]}", seq=self.state.seq, name=exp.name,
                     spec_json=exp.to_json(), created_unix=time.time())
        self.state.exps[rec.id] = rec
        await self.store.save_experiment(rec)
        await self.store.add_event("submit", f"experiment {rec.name} queued", experiment_id=rec.id)
        if not checked:
            await self.store.add_event("import_check", self.import_checker.unchecked_note(), experiment_id=rec.id)
        await self.scheduler.reconcile()
        return rec.id

    def workdir_pieces(self, req: pb.FetchWorkdirRequest) -> AsyncIterator[pb.WorkdirChunk]:
        """The code directory of `req.experiment_id` for a node that runs (or is given) one of its roles.

        Raises:
            NotFoundError: unknown node, or an experiment not on that node or shipping no such digest.
        """
        node = self.state.nodes.get(req.node_id)
        exp = self.state.exps.get(req.experiment_id)
        if node is None or exp is None or node.experiment_id != exp.id or exp.spec.get("workdir") != req.digest:
            raise NotFoundError(f"node {req.node_id!r} runs no role of an experiment {req.experiment_id!r} "
                                f"shipping workdir {req.digest!r}")
        return self.workdirs.pieces(req.digest)

    def get(self, exp_id: str) -> ExpRec:
        exp = self.state.exps.get(exp_id)
        if exp is None:
            raise NotFoundError(f"experiment {exp_id!r} does not exist")
        return exp

    def status(self, exp: ExpRec) -> pb.ExperimentStatus:
        rates, slow = worker_speeds(self.step_rates, exp)
        return views.experiment_status(exp, self.state.nodes, rates, slow)

    def assignments_for(self, node_id: str) -> list[pb.Assignment]:
        nodes = self.state.nodes
        node = nodes.get(node_id)
        if node is None or not node.experiment_id:
            return []
        exp = self.state.exps.get(node.experiment_id)
        if exp is None or not exp.active:
            return []
        keys = views.curve_keys(exp, nodes) if self.state.curve else ({}, [], {})
        return views.assignments(exp, node_id, checkpoint_root=self.state.checkpoint_root, curve_keys=keys,
                                 holders=views.checkpoint_holders(exp, nodes))

    async def cancel(self, exp_id: str) -> ExpRec:
        exp = self.get(exp_id)
        if exp.active:
            await self.scheduler.finish(exp, pb.EXPERIMENT_STATE_CANCELLED, "cancelled by user")
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
        what = f"{pb.Role.Name(req.role).removeprefix('ROLE_').lower()} {req.index} on {self.state.name(req.node_id)}"
        if req.state == pb.ROLE_STATE_FAILED:
            exp.failures += 1
            if why := failover.failure_ends(exp.user_failures, exp.failures, exp.spec["max_workers"], req):
                await self.scheduler.finish(exp, pb.EXPERIMENT_STATE_FAILED, f"{what} failed: {req.message} ({why})")
                return
            workers = len(exp.roles_of(pb.ROLE_WORKER))
            await self.recovery.drop_role(exp, role, f"{what} failed: {req.message}")
            if req.role == pb.ROLE_WORKER:
                await self.recovery.suspect_shards(exp, role, req.message, workers)
            await self.scheduler.reconcile()
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
            await self.scheduler.running(exp, "all shards serving: " + ", ".join(r.endpoint for r in servers))
        await self.store.save_experiment(exp)
        await self.state.notify(only=exp)
        if exp.completing_unix and req.state == pb.ROLE_STATE_DONE:  # its final counters came just before
            await self.settle_completion(exp)

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
                await self.state.recovery_metric(exp, {"versions_lost_min": float(lost)})
            await self.store.add_event(kind, message, experiment_id=exp.id, node_id=req.node_id)
            if kind == "restored" and lost and not req.version:  # never silently from initial values
                await self.scheduler.finish(exp, pb.EXPERIMENT_STATE_FAILED, _no_source(exp, req.index, lost))
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
            await self.state.notify(assignments=False)  # metrics never change a node's assignments
        return exp.active

    async def check_deadlines(self) -> None:
        """Act on overdue waits: a start, nodes that do not return, a run making no progress."""
        now = time.time()
        for exp in [e for e in self.state.exps.values() if e.active]:
            spec = exp.spec
            if exp.completing_unix:
                await self.settle_completion(exp)
            elif exp.state == pb.EXPERIMENT_STATE_STARTING:
                late = placement.start_overdue(exp.roles, spec["num_ps_shards"], since=exp.starting_unix, now=now,
                                               timeout_s=spec["start_timeout_s"])
                if late is not None:
                    await self.scheduler.start_late(exp, late)
            elif exp.state != pb.EXPERIMENT_STATE_RUNNING:
                continue
            elif placement.overdue(exp.waiting_unix, now=now, timeout_s=spec["node_wait_timeout_s"]):
                await self.scheduler.finish(exp, pb.EXPERIMENT_STATE_FAILED,
                                            f"no nodes came: {exp.message.partition(';')[0]} for "
                                            f"{spec['node_wait_timeout_s']:g} s (node_wait_timeout_s): giving up")
            elif not exp.waiting_unix and not exp.stalled and placement.overdue(
                    exp.progress_unix, now=now, timeout_s=spec["progress_timeout_s"]):
                exp.stalled = True
                exp.message = _stall_message(exp, now)
                await self.store.add_event("stalled", exp.message, experiment_id=exp.id)
                await self.store.save_experiment(exp)
                await self.state.notify()

    async def complete(self, req: pb.CompleteExperimentRequest) -> None:
        exp = self.get(req.experiment_id)
        if exp.active and final_reports.begin(exp, req, now=time.time()):
            await self.store.save_experiment(exp)
            await self.settle_completion(exp)

    async def settle_completion(self, exp: ExpRec) -> None:
        """Mark `exp` COMPLETED once every other worker's final counters are in, or given up on."""
        done = final_reports.settle(exp, now=time.time(), timeout_s=self.state.config.final_report_timeout_s,
                                    names={n.id: n.name for n in self.state.nodes.values()})
        if done is not None:
            if done.warning:
                await self.store.add_event("incomplete-metrics", done.warning, experiment_id=exp.id)
            await self.scheduler.finish(exp, pb.EXPERIMENT_STATE_COMPLETED, done.message)

    async def register_checkpoint(self, info: pb.CheckpointInfo) -> None:
        exp = self.get(info.experiment_id)
        await self.store.add_checkpoint(info.experiment_id, info.step, info.path, info.kind)
        if info.kind == "shard" and info.node_id in self.state.nodes:  # its disk holds it: a restore may fetch it there
            exp.checkpoint_holders[info.node_id] = max(exp.checkpoint_holders.get(info.node_id, 0), int(info.step))
            await self.store.save_experiment(exp)
        await self.store.add_event(
            "checkpoint", f"{info.kind} checkpoint at step {info.step}: {info.path}",
            experiment_id=info.experiment_id,
        )


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
