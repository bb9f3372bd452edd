"""The coordinator: a grpc.aio server for membership, role assignment, experiments and checkpoints."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gossamer.coordinator import scheduler
from gossamer.coordinator._status import code_for
from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.records import ExpRec, NodeRec, RoleRec
from gossamer.coordinator.store import Store
from gossamer.errors import ConfigError, GossamerError, NotFoundError
from gossamer.experiment import IMPLEMENTED_MODES, Experiment
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = ("gossamer.v1.NodeService", "gossamer.v1.ExperimentService", "gossamer.v1.CheckpointService")


class Coordinator:
    """All coordinator state and logic; the servicers below are thin RPC adapters over it."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.store = Store(config.state_dir)
        self.checkpoint_root = str((Path(config.state_dir) / "checkpoints").resolve())
        nodes, exps = self.store.load()
        now = time.time()
        self.nodes: dict[str, NodeRec] = {n.id: n for n in nodes}
        for n in self.nodes.values():
            # A restarted coordinator gives every live node one full lease to re-attach.
            n.last_seen = now
        self.exps: dict[str, ExpRec] = {e.id: e for e in exps}
        self._seq = max((e.seq for e in exps), default=0)
        self._changed = asyncio.Condition()
        self._import_checks: set[tuple[str, str]] = set()
        if nodes or exps:
            log.info("resumed state: %d nodes, %d experiments", len(nodes), len(exps))

    # --- change notification ---------------------------------------------------------------
    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_change(self, timeout: float) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    # --- membership ------------------------------------------------------------------------
    async def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        now = time.time()
        node = self.nodes.get(req.node_id) if req.node_id else None
        if node is not None and node.alive:
            node.last_seen = now
            await self.store.add_event("rejoin", f"node {node.name} re-attached", node_id=node.id)
        else:
            node_id = req.node_id or uuid.uuid4().hex[:12]
            node = NodeRec(
                id=node_id,
                name=req.name or f"{req.hostname or 'node'}-{node_id[:6]}",
                address=req.address or "127.0.0.1",
                hostname=req.hostname,
                spot=req.spot,
                labels=dict(req.labels),
                cpus=req.cpus,
                gpus=req.gpus,
                nproc_per_node=max(1, req.nproc_per_node),
                state=pb.NODE_STATE_READY,
                joined_unix=now,
                last_seen=now,
            )
            self.nodes[node.id] = node
            await self.store.add_event(
                "join", f"node {node.name} joined ({'spot' if node.spot else 'on-demand'})", node_id=node.id
            )
        await self.store.save_node(node)
        await self.reconcile()
        return pb.JoinResponse(
            node_id=node.id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            lease_timeout_s=self.config.lease_timeout_s,
        )

    async def heartbeat(self, node_id: str) -> bool:
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return False
        node.last_seen = time.time()
        return True

    async def leave(self, node_id: str, reason: str) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFoundError(f"node {node_id} is not known")
        if not node.alive:
            return
        await self._remove_node(node, pb.NODE_STATE_LEFT, f"left: {reason or 'no reason given'}")

    async def reap_leases(self) -> None:
        now = time.time()
        for node in list(self.nodes.values()):
            if node.alive and now - node.last_seen > self.config.lease_timeout_s:
                await self._remove_node(
                    node, pb.NODE_STATE_LOST, f"lease expired ({now - node.last_seen:.1f}s without heartbeat)"
                )

    async def _remove_node(self, node: NodeRec, state: pb.NodeState.ValueType, why: str) -> None:
        node.state = state
        exp_id, node.experiment_id = node.experiment_id, ""
        kind = "lost" if state == pb.NODE_STATE_LOST else "leave"
        await self.store.add_event(kind, f"node {node.name} {why}", experiment_id=exp_id, node_id=node.id)
        await self.store.save_node(node)
        exp = self.exps.get(exp_id)
        if exp is not None and exp.active:
            await self._role_lost(exp, node)
        await self.reconcile()

    async def _role_lost(self, exp: ExpRec, node: NodeRec) -> None:
        mine = [r for r in exp.roles if r.node_id == node.id]
        exp.roles = [r for r in exp.roles if r.node_id != node.id]
        exp.generation += 1
        for r in mine:
            if r.role == pb.ROLE_PARAMETER_SERVER:
                await self._finish(
                    exp,
                    pb.EXPERIMENT_STATE_FAILED,
                    f"parameter-server shard {r.index} lost with node {node.name}; "
                    "this release keeps no shard replica",
                )
                return
            if exp.spec["mode"] == "sync" and exp.state == pb.EXPERIMENT_STATE_RUNNING:
                await self._finish(
                    exp,
                    pb.EXPERIMENT_STATE_FAILED,
                    f"worker {r.index} lost with node {node.name}; sync mode cannot re-form its "
                    "barrier in this release",
                )
                return
            await self.store.add_event(
                "reassign", f"worker {r.index} removed (generation {exp.generation})", experiment_id=exp.id,
                node_id=node.id,
            )
        self._choose_lead(exp)
        await self.store.save_experiment(exp)

    def _choose_lead(self, exp: ExpRec) -> None:
        workers = exp.roles_of(pb.ROLE_WORKER)
        exp.lead_node = workers[0].node_id if workers else ""

    # --- scheduling ------------------------------------------------------------------------
    def _free_nodes(self) -> list[NodeRec]:
        return [n for n in self.nodes.values() if n.alive and not n.experiment_id]

    async def reconcile(self) -> None:
        """Start queued experiments and grow running async ones with free nodes."""
        for exp in sorted(self.exps.values(), key=lambda e: e.seq):
            if not exp.active:
                continue
            spec = exp.spec
            free = self._free_nodes()
            if exp.state == pb.EXPERIMENT_STATE_QUEUED:
                placement = scheduler.place(
                    free,
                    num_servers=spec["num_ps_shards"],
                    min_workers=spec["min_workers"],
                    max_workers=spec["max_workers"],
                )
                if placement is None:
                    break  # FIFO: later experiments wait behind the head of the queue
                exp.state = pb.EXPERIMENT_STATE_STARTING
                exp.generation += 1
                for i, n in enumerate(placement.servers):
                    self._bind(exp, n, pb.ROLE_PARAMETER_SERVER, i)
                for n in placement.workers:
                    self._bind(exp, n, pb.ROLE_WORKER, exp.next_worker_index)
                    exp.next_worker_index += 1
                self._choose_lead(exp)
                await self.store.add_event(
                    "schedule",
                    f"{len(placement.servers)} shard(s) on "
                    f"{', '.join(n.name for n in placement.servers)}; workers on "
                    f"{', '.join(n.name for n in placement.workers)}",
                    experiment_id=exp.id,
                )
            elif exp.state == pb.EXPERIMENT_STATE_RUNNING and spec["mode"] != "sync" and free:
                current = len(exp.roles_of(pb.ROLE_WORKER))
                added = scheduler.grow(free, current_workers=current, max_workers=spec["max_workers"])
                for n in added:
                    self._bind(exp, n, pb.ROLE_WORKER, exp.next_worker_index)
                    exp.next_worker_index += 1
                    await self.store.add_event(
                        "reassign", f"node {n.name} joins as worker {exp.next_worker_index - 1}",
                        experiment_id=exp.id, node_id=n.id,
                    )
                if added:
                    exp.generation += 1
                    self._choose_lead(exp)
            else:
                continue
            await self.store.save_experiment(exp)
            for r in exp.roles:
                await self.store.save_node(self.nodes[r.node_id])
        await self._notify()

    def _bind(self, exp: ExpRec, node: NodeRec, role: pb.Role.ValueType, index: int) -> None:
        node.experiment_id = exp.id
        node.state = pb.NODE_STATE_BUSY
        exp.roles.append(RoleRec(node_id=node.id, role=role, index=index, state=pb.ROLE_STATE_UNSPECIFIED))

    async def _finish(self, exp: ExpRec, state: pb.ExperimentState.ValueType, message: str) -> None:
        exp.state = state
        exp.message = message
        exp.finished_unix = time.time()
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
        endpoints = {r.index: r.endpoint for r in exp.roles_of(pb.ROLE_PARAMETER_SERVER)}
        workers = exp.roles_of(pb.ROLE_WORKER)
        spec = exp.spec
        out = []
        for r in exp.roles:
            if r.node_id != node_id:
                continue
            if r.role == pb.ROLE_WORKER and exp.state != pb.EXPERIMENT_STATE_RUNNING:
                continue  # workers start once every shard serves
            out.append(
                pb.Assignment(
                    experiment_id=exp.id,
                    role=r.role,
                    index=r.index,
                    num_workers=len(workers),
                    # The generation is left out of a worker's assignment in async mode so that a
                    # membership change does not look like a new role to the agent.
                    generation=exp.generation if spec["mode"] == "sync" else 0,
                    experiment_json=exp.spec_json,
                    shard_endpoints=endpoints if r.role == pb.ROLE_WORKER else {},
                    checkpoint_dir=spec.get("checkpoint_dir") or self.checkpoint_root,
                    lead=(r.role == pb.ROLE_WORKER and r.node_id == exp.lead_node),
                )
            )
        return out

    # --- experiments -----------------------------------------------------------------------
    async def submit(self, experiment_json: str) -> str:
        exp = Experiment.from_json(experiment_json)
        if exp.mode not in IMPLEMENTED_MODES:
            raise ConfigError("mode", f"mode {exp.mode!r} is not available in this release; use sync or async")
        if exp.parallelism != "ddp":
            raise ConfigError("parallelism", f"{exp.parallelism!r} is not available in this release; use 'ddp'")
        if self.config.check_imports:
            await self._check_imports(exp)
        self._seq += 1
        rec = ExpRec(
            id=f"{_slug(exp.name)}-{uuid.uuid4().hex[:6]}",
            seq=self._seq,
            name=exp.name,
            spec_json=exp.to_json(),
            created_unix=time.time(),
        )
        self.exps[rec.id] = rec
        await self.store.save_experiment(rec)
        await self.store.add_event("submit", f"experiment {rec.name} queued", experiment_id=rec.id)
        await self.reconcile()
        return rec.id

    async def _check_imports(self, exp: Experiment) -> None:
        """Import the model and dataset callables in a child interpreter (never torch in here)."""
        key = (exp.model, exp.dataset)
        if key in self._import_checks:
            return
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gossamer._import_check", exp.model, exp.dataset,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
        except asyncio.TimeoutError:
            proc.kill()
            raise ConfigError("model", "importing the model/dataset took over 120 s") from None
        verdict = out.decode().strip()
        if verdict != "ok":  # only successes are cached: a fixed module is checked again
            field, _, msg = verdict.partition(": ")
            raise ConfigError(field if field in ("model", "dataset") else "model", msg or verdict)
        self._import_checks.add(key)

    def get(self, exp_id: str) -> ExpRec:
        exp = self.exps.get(exp_id)
        if exp is None:
            raise NotFoundError(f"experiment {exp_id!r} does not exist")
        return exp

    def status(self, exp: ExpRec) -> pb.ExperimentStatus:
        spec = exp.spec
        return pb.ExperimentStatus(
            id=exp.id,
            name=exp.name,
            state=exp.state,
            steps=exp.steps,
            total_steps=spec["total_steps"],
            generation=exp.generation,
            created_unix=exp.created_unix,
            started_unix=exp.started_unix,
            finished_unix=exp.finished_unix,
            message=exp.message,
            checkpoint=exp.checkpoint,
            metrics_json=json.dumps(exp.totals()),
            roles=[
                pb.RoleBinding(
                    node_id=r.node_id,
                    node_name=self.nodes[r.node_id].name if r.node_id in self.nodes else "",
                    role=r.role,
                    index=r.index,
                    state=r.state,
                    endpoint=r.endpoint,
                )
                for r in exp.roles
            ],
            experiment_json=exp.spec_json,
        )

    async def cancel(self, exp_id: str) -> ExpRec:
        exp = self.get(exp_id)
        if exp.active:
            await self._finish(exp, pb.EXPERIMENT_STATE_CANCELLED, "cancelled by user")
        return exp

    async def report_role(self, req: pb.ReportRoleRequest) -> None:
        exp = self.get(req.experiment_id)
        role = next(
            (r for r in exp.roles if r.node_id == req.node_id and r.role == req.role and r.index == req.index),
            None,
        )
        if role is None or not exp.active:
            return  # a stale report from a role the coordinator already moved on from
        role.state = req.state
        role.endpoint = req.endpoint or role.endpoint
        role.message = req.message
        node_name = self.nodes[req.node_id].name if req.node_id in self.nodes else req.node_id
        if req.state == pb.ROLE_STATE_FAILED:
            await self._finish(
                exp, pb.EXPERIMENT_STATE_FAILED,
                f"{pb.Role.Name(req.role).removeprefix('ROLE_').lower()} {req.index} on {node_name} "
                f"failed: {req.message}",
            )
            return
        servers = exp.roles_of(pb.ROLE_PARAMETER_SERVER)
        if (
            exp.state == pb.EXPERIMENT_STATE_STARTING
            and len(servers) == exp.spec["num_ps_shards"]
            and all(r.state == pb.ROLE_STATE_SERVING and r.endpoint for r in servers)
        ):
            exp.state = pb.EXPERIMENT_STATE_RUNNING
            exp.started_unix = exp.started_unix or time.time()
            await self.store.add_event(
                "running", "all shards serving: " + ", ".join(r.endpoint for r in servers), experiment_id=exp.id
            )
        await self.store.save_experiment(exp)
        await self._notify()

    async def report_metrics(self, req: pb.ReportMetricsRequest) -> bool:
        exp = self.get(req.experiment_id)
        rows = []
        for p in req.points:
            values = dict(p.values)
            rows.append((p.time_unix, p.step, p.source, values))
            merged = exp.latest.setdefault(p.source, {})
            merged.update(values)
            merged["time_unix"] = p.time_unix
            if exp.active:
                exp.steps = max(exp.steps, p.step)
        if rows:
            await self.store.add_metrics(exp.id, rows)
            await self.store.save_experiment(exp)
            await self._notify()
        return exp.active

    async def complete(self, req: pb.CompleteExperimentRequest) -> None:
        exp = self.get(req.experiment_id)
        if not exp.active:
            return
        exp.final_metrics = dict(req.final_metrics)
        exp.checkpoint = req.checkpoint
        exp.steps = int(req.final_metrics.get("steps", exp.steps))
        acc = req.final_metrics.get("eval_accuracy")
        await self._finish(
            exp, pb.EXPERIMENT_STATE_COMPLETED,
            f"completed {exp.steps} steps" + (f", eval accuracy {acc:.4f}" if acc is not None else ""),
        )

    # --- checkpoints -----------------------------------------------------------------------
    async def register_checkpoint(self, info: pb.CheckpointInfo) -> None:
        self.get(info.experiment_id)
        await self.store.add_checkpoint(info.experiment_id, info.step, info.path, info.kind)
        await self.store.add_event(
            "checkpoint", f"{info.kind} checkpoint at step {info.step}: {info.path}",
            experiment_id=info.experiment_id,
        )

    def node_info(self, n: NodeRec) -> pb.NodeInfo:
        role: pb.Role.ValueType = pb.ROLE_UNSPECIFIED
        index = -1
        exp = self.exps.get(n.experiment_id)
        if exp is not None:
            mine = next((r for r in exp.roles if r.node_id == n.id), None)
            if mine is not None:
                role, index = mine.role, mine.index
        return pb.NodeInfo(
            id=n.id, name=n.name, address=n.address, hostname=n.hostname, spot=n.spot, labels=n.labels,
            cpus=n.cpus, gpus=n.gpus, nproc_per_node=n.nproc_per_node, state=n.state, role=role,
            experiment_id=n.experiment_id, lease_age_s=max(0.0, time.time() - n.last_seen), role_index=index,
        )


def _slug(name: str) -> str:
    s = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return (s or "exp")[:40]


# ----------------------------------------------------------------------------------------------
# Servicers: translate RPCs, map errors to status codes in one place.
# ----------------------------------------------------------------------------------------------
async def _guard(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, GossamerError):
        await context.abort(code_for(exc), str(exc))
    log.exception("internal error")
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class NodeServicer(pb_grpc.NodeServiceServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.c = coord

    async def Join(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return await self.c.join(request)
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        return pb.HeartbeatResponse(known=await self.c.heartbeat(request.node_id))

    async def Leave(self, request, context):  # type: ignore[no-untyped-def]
        try:
            await self.c.leave(request.node_id, request.reason)
            return pb.LeaveResponse()
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def WatchAssignments(self, request, context) -> AsyncIterator[pb.AssignmentSet]:  # type: ignore[no-untyped-def,override]
        if request.node_id not in self.c.nodes:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node {request.node_id} is not known; join first")
        last: bytes | None = None
        while True:
            assignments = self.c.assignments_for(request.node_id)
            blob = b"".join(a.SerializeToString(deterministic=True) for a in assignments)
            if blob != last:
                last = blob
                yield pb.AssignmentSet(serial=time.time_ns(), assignments=assignments)
            await self.c.wait_change(timeout=5.0)

    async def ReportRole(self, request, context):  # type: ignore[no-untyped-def]
        try:
            await self.c.report_role(request)
            return pb.ReportRoleResponse()
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def ListNodes(self, request, context):  # type: ignore[no-untyped-def]
        nodes = sorted(self.c.nodes.values(), key=lambda n: n.joined_unix)
        return pb.ListNodesResponse(nodes=[self.c.node_info(n) for n in nodes])


class ExperimentServicer(pb_grpc.ExperimentServiceServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.c = coord

    async def Submit(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return pb.SubmitResponse(experiment_id=await self.c.submit(request.experiment_json))
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def Get(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return self.c.status(self.c.get(request.experiment_id))
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def List(self, request, context):  # type: ignore[no-untyped-def]
        exps = sorted(self.c.exps.values(), key=lambda e: e.seq)
        return pb.ListExperimentsResponse(experiments=[self.c.status(e) for e in exps])

    async def Watch(self, request, context) -> AsyncIterator[pb.ExperimentStatus]:  # type: ignore[no-untyped-def,override]
        try:
            exp = self.c.get(request.experiment_id)
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)
            return
        last = None
        while True:
            status = self.c.status(exp)
            blob = status.SerializeToString(deterministic=True)
            if blob != last:
                last = blob
                yield status
            if not exp.active:
                return
            await asyncio.sleep(0.25)  # at most four updates a second
            await self.c.wait_change(timeout=2.0)

    async def Cancel(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return self.c.status(await self.c.cancel(request.experiment_id))
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def ReportMetrics(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return pb.ReportMetricsResponse(running=await self.c.report_metrics(request))
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def GetMetrics(self, request, context):  # type: ignore[no-untyped-def]
        try:
            self.c.get(request.experiment_id)
            rows = await self.c.store.metrics(request.experiment_id, request.since_unix)
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)
            return None
        return pb.GetMetricsResponse(
            points=[
                pb.MetricPoint(time_unix=t, step=s, source=src,
                               values={k: float(v) for k, v in vals.items() if isinstance(v, (int, float))})
                for t, s, src, vals in rows
            ]
        )

    async def Complete(self, request, context):  # type: ignore[no-untyped-def]
        try:
            await self.c.complete(request)
            return pb.CompleteExperimentResponse()
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    def __init__(self, coord: Coordinator) -> None:
        self.c = coord

    async def Register(self, request, context):  # type: ignore[no-untyped-def]
        try:
            await self.c.register_checkpoint(request.checkpoint)
            return pb.RegisterCheckpointResponse()
        except Exception as e:  # noqa: BLE001
            await _guard(context, e)

    async def Latest(self, request, context):  # type: ignore[no-untyped-def]
        row = await self.c.store.latest_checkpoint(request.experiment_id)
        if row is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint for {request.experiment_id!r}")
        step, path, kind, t = row  # type: ignore[misc]
        return pb.LatestCheckpointResponse(
            checkpoint=pb.CheckpointInfo(
                experiment_id=request.experiment_id, step=step, path=path, kind=kind, time_unix=t
            )
        )


class CoordinatorServer:
    """A running coordinator: grpc.aio server, health service, lease reaper."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.coord: Coordinator | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.coord = Coordinator(self.config)
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)]
        )
        pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(self.coord), self.server)
        pb_grpc.add_ExperimentServiceServicer_to_server(ExperimentServicer(self.coord), self.server)
        pb_grpc.add_CheckpointServiceServicer_to_server(CheckpointServicer(self.coord), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise ConfigError("port", f"cannot bind {self.config.host}:{self.config.port}")
        await self.server.start()
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap())
        await self.coord.reconcile()
        log.info("coordinator serving on %s:%d (state in %s)", self.config.host, self.port, self.config.state_dir)
        return self.port

    async def _reap(self) -> None:
        assert self.coord is not None
        while True:
            await asyncio.sleep(min(0.5, self.config.heartbeat_interval_s))
            try:
                await self.coord.reap_leases()
            except Exception:  # noqa: BLE001 — the reaper must survive anything
                log.exception("lease reaper")

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        if self._reaper is not None:
            self._reaper.cancel()
        if self.server is not None:
            await self.server.stop(self.config.grace_s)
        if self.coord is not None:
            self.coord.store.close()

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def serve(config: CoordinatorConfig, ready_file: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully."""
    srv = CoordinatorServer(config)
    port = await srv.start()
    if ready_file:
        tmp = f"{ready_file}.tmp"
        Path(tmp).write_text(str(port))
        os.replace(tmp, ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await srv.stop()
