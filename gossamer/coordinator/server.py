"""The coordinator: a grpc.aio server for membership, role assignment, experiments and checkpoints."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gossamer.coordinator import scheduler
from gossamer.coordinator._malformed import MalformedRequestInterceptor
from gossamer.coordinator._status import code_for
from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.http import HttpConfig, StatusHttp
from gossamer.coordinator.records import ExpRec, NodeRec, RoleRec
from gossamer.coordinator.store import Store
from gossamer.coordinator.stragglers import StepRates, worker_speeds
from gossamer.errors import ConfigError, GossamerError, NotFoundError
from gossamer.experiment import IMPLEMENTED_MODES, Experiment
from gossamer.security.serving import describe_security, server_interceptors
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = ("gossamer.v1.NodeService", "gossamer.v1.ExperimentService", "gossamer.v1.CheckpointService")


class Coordinator:
    """All coordinator state and logic; the servicers below are thin RPC adapters over it."""

    #: The CoordinatorServer serving this state: /metrics shows its gRPC restart and refusal counts.
    grpc_server: CoordinatorServer | None = None

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
            n.stream_lost_at = 0.0
        self.exps: dict[str, ExpRec] = {e.id: e for e in exps}
        self._seq = max((e.seq for e in exps), default=0)
        self._changed = asyncio.Event()  # replaced by a fresh one at every change
        self._import_checks: set[tuple[str, str]] = set()
        self.curve = config.data_plane_curve
        if self.curve:
            import zmq  # not at import time: a plaintext coordinator never loads ZMQ

            if not zmq.has("curve"):
                raise ConfigError("curve", "this pyzmq/libzmq was built without CURVE support")
        self.step_rates = StepRates()  # per-node step rates from workers' reports (stragglers)
        if nodes or exps:
            log.info("resumed state: %d nodes, %d experiments", len(nodes), len(exps))

    # --- change notification ---------------------------------------------------------------
    # An Event swapped at each change, not a Condition: on Python 3.11 a Condition.wait()
    # cancelled by wait_for at shutdown can leave its lock released, and `async with` then
    # raised "Lock is not acquired" in every stream handler, so SIGTERM did not end the process.
    async def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # --- membership ------------------------------------------------------------------------
    def _curve_key(self, req: pb.JoinRequest) -> str:
        """The joining node's public CURVE key ("" when the data plane runs without CURVE)."""
        if not self.curve:
            return ""
        if not req.curve_public_key:
            raise ConfigError("curve_public_key", "this coordinator runs the data plane with CurveZMQ (--curve) "
                              "and the node sent no CURVE public key: upgrade gossamer on the node")
        from gossamer.security.curve import check_public_key

        return check_public_key(req.curve_public_key)

    async def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        now = time.time()
        curve_key = self._curve_key(req)
        node = self.nodes.get(req.node_id) if req.node_id else None
        if node is not None and node.alive:
            node.last_seen = now
            node.curve_key = curve_key  # the same key after a coordinator restart; assignments follow a new one
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
                curve_key=curve_key,
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
            curve=self.curve,
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

    def stream_opened(self, node_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.stream_lost_at = 0.0

    def stream_closed(self, node_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None and node.alive:
            node.stream_lost_at = time.time()

    async def reap_leases(self) -> None:
        """Declare nodes lost: lease expired, or stream dropped and no heartbeat since.

        A process that dies (kill -9, OOM, crash) closes its TCP connections at once, so its
        assignment stream ends here; a live node reconnects it or heartbeats within one
        interval. Two quiet intervals after the drop are enough evidence; a machine that
        vanishes without closing anything is caught by the lease.
        """
        now = time.time()
        fast = 2.0 * self.config.heartbeat_interval_s
        for node in list(self.nodes.values()):
            if not node.alive:
                continue
            silent = now - node.last_seen
            if silent > self.config.lease_timeout_s:
                await self._remove_node(node, pb.NODE_STATE_LOST,
                                        f"lease expired ({silent:.1f}s without heartbeat)", silent)
            elif node.stream_lost_at and now - node.stream_lost_at > fast and node.last_seen < node.stream_lost_at:
                await self._remove_node(
                    node, pb.NODE_STATE_LOST,
                    f"connection closed and no heartbeat for {silent:.1f}s", silent,
                )

    async def _remove_node(self, node: NodeRec, state: pb.NodeState.ValueType, why: str,
                           detect_s: float | None = None) -> None:
        node.state = state
        exp_id, node.experiment_id = node.experiment_id, ""
        kind = "lost" if state == pb.NODE_STATE_LOST else "leave"
        await self.store.add_event(kind, f"node {node.name} {why}", experiment_id=exp_id, node_id=node.id)
        await self.store.save_node(node)
        exp = self.exps.get(exp_id)
        if exp is not None and exp.active:
            figures = {"nodes_lost" if kind == "lost" else "nodes_left": 1.0}
            if detect_s is not None:
                figures["detect_s"] = detect_s
            await self._recovery_metric(exp, figures)
            await self._node_gone(exp, node)
        await self.reconcile()

    async def _recovery_metric(self, exp: ExpRec, add: dict[str, float]) -> None:
        """Coordinator-side recovery figures: counts add up; detect_s keeps last and max."""
        cur = exp.latest.setdefault("coordinator", {})
        for k, v in add.items():
            if k == "detect_s":
                cur["detect_s_last"] = v
                cur["detect_s_max"] = max(cur.get("detect_s_max", 0.0), v)
            else:
                cur[k] = cur.get(k, 0.0) + v
        cur["time_unix"] = time.time()
        values = {k: v for k, v in cur.items() if k != "time_unix"}
        await self.store.add_metrics(exp.id, [(cur["time_unix"], exp.steps, "coordinator", values)])

    async def _node_gone(self, exp: ExpRec, node: NodeRec) -> None:
        """Every role `node` had in `exp` is gone: re-plan them."""
        mine = [r for r in exp.roles if r.node_id == node.id]
        exp.roles = [r for r in exp.roles if r.node_id != node.id]
        exp.generation += 1
        # Primaries first: a lost primary may promote a backup that was on this node too.
        for r in sorted(mine, key=lambda r: (r.role, r.replica)):
            await self._replace_role(exp, r, node.name)
        self._choose_lead(exp)
        await self.store.save_experiment(exp)

    async def _drop_role(self, exp: ExpRec, role: RoleRec, why: str) -> None:
        """One role process failed on a node that lives on: re-plan just that role."""
        exp.roles = [r for r in exp.roles if r is not role]
        exp.generation += 1
        node = self.nodes.get(role.node_id)
        await self.store.add_event("lost", why, experiment_id=exp.id, node_id=role.node_id)
        await self._release_if_idle(exp, role.node_id)
        await self._replace_role(exp, role, node.name if node else role.node_id)
        self._choose_lead(exp)
        await self.store.save_experiment(exp)

    async def _replace_role(self, exp: ExpRec, r: RoleRec, where: str) -> None:
        if r.role == pb.ROLE_WORKER:
            left = len(exp.roles_of(pb.ROLE_WORKER))
            await self.store.add_event(
                "reassign", f"worker {r.index} on {where} removed; {left} worker(s) remain "
                f"(generation {exp.generation})", experiment_id=exp.id, node_id=r.node_id,
            )
            return
        replicas = [x for x in exp.roles if x.role == pb.ROLE_PARAMETER_SERVER and x.index == r.index]
        if r.replica == 1:
            await self.store.add_event("reassign", f"backup of shard {r.index} on {where} lost",
                                       experiment_id=exp.id, node_id=r.node_id)
            for x in replicas:
                x.replicated = False
        else:
            backup = next((x for x in replicas if x.replica == 1), None)
            if backup is not None and r.replicated and backup.state == pb.ROLE_STATE_SERVING and backup.endpoint:
                backup.replica = 0
                backup.replicated = False
                await self._recovery_metric(exp, {"promotions": 1.0})
                await self.store.add_event(
                    "promote", f"shard {r.index}: primary on {where} gone; backup on "
                    f"{self._name(backup.node_id)} promoted ({backup.endpoint})",
                    experiment_id=exp.id, node_id=backup.node_id,
                )
            else:
                await self._restore_shard(exp, r.index, where, replicas)
                return
        await self._place_backup(exp, r.index)

    async def _restore_shard(self, exp: ExpRec, index: int, where: str, replicas: list[RoleRec]) -> None:
        """Every usable replica of shard `index` is gone: a new primary loads the checkpoint."""
        exp.roles = [x for x in exp.roles if x not in replicas]  # an unsynced backup cannot serve
        for x in replicas:
            await self._release_if_idle(exp, x.node_id)
        host = self._replica_host(exp, index)
        if host is None:
            await self._finish(exp, pb.EXPERIMENT_STATE_FAILED,
                               f"shard {index} lost with {where} and no node can take it")
            return
        exp.restore_epoch += 1
        targets = [index]
        if exp.spec["mode"] == "sync":
            # BSP needs every shard at the same step: all shards roll back together.
            targets = sorted({index} | {x.index for x in exp.roles_of(pb.ROLE_PARAMETER_SERVER)})
            for x in exp.roles:
                if x.role == pb.ROLE_PARAMETER_SERVER:
                    x.restore_epoch = exp.restore_epoch
        self._bind(exp, host, pb.ROLE_PARAMETER_SERVER, index)
        exp.roles[-1].restore_epoch = exp.restore_epoch
        await self._recovery_metric(exp, {"restores": 1.0})
        await self.store.add_event(
            "restore", f"shard {index}: every replica gone (last on {where}); restoring from the newest good "
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

    def _replica_host(self, exp: ExpRec, index: int) -> NodeRec | None:
        avoid = {x.node_id for x in exp.roles if x.role == pb.ROLE_PARAMETER_SERVER and x.index == index}
        servers = [self.nodes[x.node_id] for x in exp.roles
                   if x.role == pb.ROLE_PARAMETER_SERVER and x.node_id in self.nodes]
        workers = [self.nodes[x.node_id] for x in exp.roles if x.role == pb.ROLE_WORKER and x.node_id in self.nodes]
        return scheduler.replica_host(avoid=avoid, servers=servers, free=self._free_nodes(), workers=workers)

    async def _place_backup(self, exp: ExpRec, index: int) -> None:
        if not exp.spec.get("ps_backup", True) or not exp.active:
            return
        host = self._replica_host(exp, index)
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
                serverless = _serverless(spec)
                placement = scheduler.place(
                    free,
                    num_servers=0 if serverless else spec["num_ps_shards"],
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
                for i in range(len(placement.servers)):
                    await self._place_backup(exp, i)
                self._choose_lead(exp)
                await self.store.add_event(
                    "schedule",
                    (f"{len(placement.servers)} shard(s) on {', '.join(n.name for n in placement.servers)}; "
                     if not serverless else "no parameter servers (gossip); ")
                    + f"workers on {', '.join(n.name for n in placement.workers)}",
                    experiment_id=exp.id,
                )
                if serverless:  # nothing to wait for: the workers find each other
                    exp.state = pb.EXPERIMENT_STATE_RUNNING
                    exp.started_unix = exp.started_unix or time.time()
                    await self.store.add_event("running", "gossip workers starting", experiment_id=exp.id)
            elif exp.state == pb.EXPERIMENT_STATE_RUNNING and free:
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
        self.step_rates.forget(exp.id)
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
        servers = exp.roles_of(pb.ROLE_PARAMETER_SERVER)
        primaries = {r.index: r for r in servers if r.replica == 0}
        backups = {r.index: r for r in servers if r.replica == 1}
        endpoints = {i: r.endpoint for i, r in primaries.items() if r.endpoint}
        workers = exp.roles_of(pb.ROLE_WORKER)
        senders = [f"{w.node_id}:{w.index}" for w in workers]
        peers = {w.index: w.endpoint for w in workers if w.endpoint} if _serverless(exp.spec) else {}
        server_keys, members = self._curve_keys(exp)
        spec = exp.spec
        out = []
        for r in exp.roles:
            if r.node_id != node_id:
                continue
            if r.role == pb.ROLE_WORKER and exp.state != pb.EXPERIMENT_STATE_RUNNING:
                continue  # workers start once every shard serves
            ps = r.role == pb.ROLE_PARAMETER_SERVER
            backup = backups.get(r.index) if ps and r.replica == 0 else None
            out.append(
                pb.Assignment(
                    experiment_id=exp.id,
                    role=r.role,
                    index=r.index,
                    num_workers=len(workers),
                    generation=exp.generation,
                    experiment_json=exp.spec_json,
                    shard_endpoints=endpoints if not ps else {},
                    checkpoint_dir=spec.get("checkpoint_dir") or self.checkpoint_root,
                    lead=(not ps and r.node_id == exp.lead_node),
                    replica=r.replica,
                    backup_endpoint=backup.endpoint if backup and backup.state == pb.ROLE_STATE_SERVING else "",
                    workers=senders if ps else [],
                    restore_epoch=r.restore_epoch,
                    worker_rank=workers.index(r) if not ps else 0,
                    peer_endpoints={i: e for i, e in peers.items() if i != r.index} if not ps else {},
                    curve_server_keys=server_keys,
                    curve_members=members,
                )
            )
        return out

    def _curve_keys(self, exp: ExpRec) -> tuple[dict[str, str], list[str]]:
        """CurveZMQ: (endpoint -> public key of the node serving it, public keys of the members).

        Members are the nodes holding a role in `exp` now: a node that is lost, leaves or
        loses its role drops out, and the shards and peers refuse its key from then on.
        """
        if not self.curve:
            return {}, []
        keys = {r.node_id: self.nodes[r.node_id].curve_key for r in exp.roles
                if r.node_id in self.nodes and self.nodes[r.node_id].curve_key}
        endpoints = {r.endpoint: keys[r.node_id] for r in exp.roles if r.endpoint and r.node_id in keys}
        return endpoints, sorted(set(keys.values()))

    # --- experiments -----------------------------------------------------------------------
    async def submit(self, experiment_json: str) -> str:
        exp = Experiment.from_json(experiment_json)
        if exp.mode not in IMPLEMENTED_MODES:
            raise ConfigError("mode", f"mode {exp.mode!r} is not available in this release")
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
        rates, slow = worker_speeds(self.step_rates, exp)
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
                    replica=r.replica,
                    step_rate=rates.get(r.node_id, 0.0) if r.role == pb.ROLE_WORKER else 0.0,
                    straggler=r.role == pb.ROLE_WORKER and r.node_id in slow,
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
            if exp.failures > max(10, 3 * exp.spec["max_workers"]):
                await self._finish(exp, pb.EXPERIMENT_STATE_FAILED,
                                   f"{what} failed: {req.message} ({exp.failures} role failures: giving up)")
                return
            await self._drop_role(exp, role, f"{what} failed: {req.message}")
            await self.reconcile()
            return
        if req.role == pb.ROLE_WORKER and req.state == pb.ROLE_STATE_SERVING:
            await self.store.add_event("ready", f"{what} ready (model built, parameters pulled next)",
                                       experiment_id=exp.id, node_id=req.node_id)
        if req.role == pb.ROLE_PARAMETER_SERVER:
            if role.replica == 0 and req.replicated != role.replicated:
                role.replicated = req.replicated
                await self.store.add_event(
                    "replicated" if req.replicated else "degraded",
                    f"shard {req.index}: backup {'attached' if req.replicated else 'detached'} at version {req.version}",
                    experiment_id=exp.id, node_id=req.node_id,
                )
            if req.restored_from or (role.restore_epoch and req.version == 0 and not role.version):
                last = exp.shard_versions.get(str(req.index), 0)
                lost = max(0, last - int(req.version))
                await self._recovery_metric(exp, {"versions_lost_min": float(lost)})
                await self.store.add_event(
                    "restored", f"shard {req.index} restored from {req.restored_from or 'its initial values'} at "
                    f"version {req.version}; at least {lost} version(s) lost (last reported version {last}; the "
                    "exact count follows as workers return)",
                    experiment_id=exp.id, node_id=req.node_id,
                )
            role.version = int(req.version)
        servers = exp.roles_of(pb.ROLE_PARAMETER_SERVER)
        primaries = [r for r in servers if r.replica == 0]
        if (
            exp.state == pb.EXPERIMENT_STATE_STARTING
            and len(primaries) == exp.spec["num_ps_shards"]
            and all(r.state == pb.ROLE_STATE_SERVING and r.endpoint for r in servers)
            and all(r.replicated for r in primaries if any(b.replica == 1 and b.index == r.index for b in servers))
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
        for p in req.points:  # a NaN time broke the metrics table's NOT NULL and the ordering of points
            if not math.isfinite(p.time_unix):
                raise ConfigError("time_unix", f"a metric point needs a finite time, got {p.time_unix!r}")
        rows = []
        for p in req.points:
            values = dict(p.values)
            rows.append((p.time_unix, p.step, p.source, values))
            merged = exp.latest.setdefault(p.source, {})
            if p.time_unix < merged.get("time_unix", 0.0):
                # A point that arrives late (a role's flush overtook its reporter thread) never
                # replaces a newer value of the same source.
                for k, v in values.items():
                    merged.setdefault(k, v)
            else:
                await self._note_discards(exp, p.source, merged, values)
                merged.update(values)
                merged["time_unix"] = p.time_unix
            shard = p.source.rpartition("/ps")[2]
            if shard.isdigit():
                key = shard
                exp.shard_versions[key] = max(exp.shard_versions.get(key, 0), int(p.step))
            if exp.active:
                exp.steps = max(exp.steps, p.step)
        self.step_rates.observe_points(exp.id, req.points)
        if rows:
            await self.store.add_metrics(exp.id, rows)
            await self.store.save_experiment(exp)
            await self._notify()
        return exp.active

    async def _note_discards(self, exp: ExpRec, source: str, old: dict[str, float], new: dict[str, float]) -> None:
        """Every discarded update shows in the event log, by cause (nothing degrades silently)."""
        lost = new.get("versions_lost", 0.0) - old.get("versions_lost", 0.0)
        if lost > 0:
            await self.store.add_event(
                "lost-updates", f"{source}: {int(lost)} update(s) rolled back by a restore from checkpoint "
                f"(total {int(new['versions_lost'])})", experiment_id=exp.id,
            )
        for k, v in new.items():
            if k.startswith("discarded_") and v > old.get(k, 0.0):
                n = int(v - old.get(k, 0.0))
                await self.store.add_event(
                    "discard", f"{source}: {n} update(s) not applied, cause {k.removeprefix('discarded_')} "
                    f"(total {int(v)})", experiment_id=exp.id,
                )

    async def complete(self, req: pb.CompleteExperimentRequest) -> None:
        exp = self.get(req.experiment_id)
        if not exp.active:
            return
        steps = req.final_metrics.get("steps", float(exp.steps))
        if not (math.isfinite(steps) and 0 <= steps < 2**63):  # else every later status() of it fails
            raise ConfigError("final_metrics", f"'steps' must be a step count, got {steps!r}")
        exp.final_metrics = dict(req.final_metrics)
        exp.checkpoint = req.checkpoint
        exp.steps = int(steps)
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


def _serverless(spec: dict[str, Any]) -> bool:
    """Gossip (and decentralized DiLoCo) run without parameter servers."""
    return spec["mode"] == "gossip" or (spec["mode"] == "diloco" and spec.get("outer_step") == "gossip")


def _slug(name: str) -> str:
    s = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return (s or "exp")[:40]


# ----------------------------------------------------------------------------------------------
# Servicers: translate RPCs, map errors to status codes in one place.
# ----------------------------------------------------------------------------------------------
def _detail(text: str, limit: int = 1024) -> str:
    """A status message short enough for clients' 16 KiB metadata limit (ids in it come from requests)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def _guard(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, GossamerError):
        await context.abort(code_for(exc), _detail(str(exc)))
    log.exception("internal error")
    await context.abort(grpc.StatusCode.INTERNAL, _detail(f"{type(exc).__name__}: {exc}"))


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
            await context.abort(grpc.StatusCode.NOT_FOUND, _detail(f"node {request.node_id} is not known; join first"))
        last: bytes | None = None
        self.c.stream_opened(request.node_id)
        try:
            while True:
                assignments = self.c.assignments_for(request.node_id)
                blob = b"".join(a.SerializeToString(deterministic=True) for a in assignments)
                if blob != last:
                    last = blob
                    yield pb.AssignmentSet(serial=time.time_ns(), assignments=assignments)
                await self.c.wait_change(timeout=5.0)
        finally:  # the node's connection is gone (or it reconnects): evidence for the reaper
            self.c.stream_closed(request.node_id)

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

    async def ListEvents(self, request, context):  # type: ignore[no-untyped-def]
        rows = await self.c.store.events(request.experiment_id or None, request.since_unix)
        return pb.ListEventsResponse(events=[
            pb.Event(time_unix=e["time"], experiment_id=e["experiment_id"], node_id=e["node_id"], kind=e["kind"],
                     message=e["message"])
            for e in rows
        ])


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
            await context.abort(grpc.StatusCode.NOT_FOUND, _detail(f"no checkpoint for {request.experiment_id!r}"))
        step, path, kind, t = row  # type: ignore[misc]
        return pb.LatestCheckpointResponse(
            checkpoint=pb.CheckpointInfo(
                experiment_id=request.experiment_id, step=step, path=path, kind=kind, time_unix=t
            )
        )


class CoordinatorServer:
    """A running coordinator: grpc.aio server, health service, lease reaper."""

    def __init__(self, config: CoordinatorConfig, http: HttpConfig | None = None) -> None:
        self.config = config
        self.http_config = http  # the status page and /metrics; None: not served
        self.http: StatusHttp | None = None
        self.http_port = 0
        self.coord: Coordinator | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._reaper: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._stopping = False
        self.restarts = 0  # gRPC servers brought back after a malformed request stopped one
        self.malformed = MalformedRequestInterceptor()  # .refused: requests whose body did not parse

    async def start(self) -> int:
        self.coord = Coordinator(self.config)
        self.coord.grpc_server = self
        self.port = await self._start_grpc(self.config.port)
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap())
        self._keeper = asyncio.create_task(self._keep_serving())
        await self.coord.reconcile()
        if self.http_config is not None:
            self.http = StatusHttp(self.coord, self.http_config)
            self.http_port = await self.http.start()
            log.info("status page and /metrics on http://%s:%d/", self.http_config.host, self.http_port)
        log.info("coordinator serving on %s:%d (state in %s; %s)", self.config.host, self.port, self.config.state_dir,
                 describe_security(self.config))
        return self.port

    async def _start_grpc(self, port: int) -> int:
        """Build, bind and start the gRPC server on `port` (0: a free one); returns the bound port."""
        assert self.coord is not None
        server = grpc.aio.server(
            interceptors=[*server_interceptors(self.config), self.malformed],
            options=[("grpc.max_receive_message_length", self.config.max_message_bytes), ("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(self.coord), server)
        pb_grpc.add_ExperimentServiceServicer_to_server(ExperimentServicer(self.coord), server)
        pb_grpc.add_CheckpointServiceServicer_to_server(CheckpointServicer(self.coord), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        bind, tls = f"{self.config.host}:{port}", self.config.tls
        bound = server.add_secure_port(bind, tls.server_credentials()) if tls else server.add_insecure_port(bind)
        if bound == 0:
            raise ConfigError("port", f"cannot bind {self.config.host}:{port}")
        await server.start()
        self.server = server
        return bound

    async def _keep_serving(self) -> None:
        """Start the gRPC server again, same port and state, whenever it stops on its own.

        grpc.aio (grpcio 1.85) shuts its whole server down when a single request's HTTP/2
        :path is not UTF-8 (its serving loop decodes the method name unchecked), so one
        malformed frame from anyone who reaches the port would end the coordinator's service.
        """
        while not self._stopping:
            server = self.server
            assert server is not None
            try:
                if await server.wait_for_termination(timeout=0.25):
                    continue  # still serving
                why = "stopped"
            except Exception as e:  # noqa: BLE001 — what crashed it
                why = f"{type(e).__name__}: {e}"
            if self._stopping:
                return
            log.warning("gRPC server on port %d stopped by a request (%s); serving again", self.port, why[:200])
            try:  # a crashed server never finishes its own shutdown: cancel its calls, free the port
                await asyncio.wait_for(server.stop(0), 5)
            except Exception:  # noqa: BLE001
                log.warning("the stopped gRPC server did not shut down cleanly", exc_info=True)
            while not self._stopping:
                try:
                    await self._start_grpc(self.port)
                    self.restarts += 1
                    break
                except Exception:  # noqa: BLE001 — the port may take a moment to come free
                    log.exception("gRPC server could not restart on port %d; retrying", self.port)
                    await asyncio.sleep(0.5)

    async def _reap(self) -> None:
        assert self.coord is not None
        while True:
            await asyncio.sleep(min(0.5, self.config.heartbeat_interval_s))
            try:
                await self.coord.reap_leases()
            except Exception:  # noqa: BLE001 — the reaper must survive anything
                log.exception("lease reaper")

    async def stop(self) -> None:
        self._stopping = True
        if self._keeper is not None:
            self._keeper.cancel()
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        if self._reaper is not None:
            self._reaper.cancel()
        if self.server is not None:
            await self.server.stop(self.config.grace_s)
        if self.coord is not None:
            self.coord.store.close()

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def serve(config: CoordinatorConfig, ready_file: str | None = None, http: HttpConfig | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully.

    With `http`, the status page and /metrics are served too, and the bound HTTP port is
    written to `<state_dir>/http.port` (before `ready_file`, so it is there once that is).
    """
    srv = CoordinatorServer(config, http)
    port = await srv.start()
    if srv.http is not None:
        http_file = Path(config.state_dir) / "http.port"
        Path(f"{http_file}.tmp").write_text(str(srv.http_port))
        os.replace(f"{http_file}.tmp", http_file)
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
