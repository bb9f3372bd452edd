"""What the coordinator tells nodes and clients (assignments, experiment status, node info), built from its records."""

from __future__ import annotations

import json
from collections.abc import Mapping

from gossamer.coordinator.records import ExpRec, NodeRec
from gossamer.security.sender_tokens import fetch_token, primary_sender, token_for
from gossamer.v1 import coordinator_pb2 as pb

#: What `curve_keys` returns: (server keys by endpoint, member keys, sender keys by sender id).
CurveKeys = tuple[dict[str, str], list[str], dict[str, str]]


def assignments(exp: ExpRec, node_id: str, *, checkpoint_root: str,
                curve_keys: CurveKeys = ({}, [], {}),
                holders: Mapping[str, tuple[str, str, str]] | None = None) -> list[pb.Assignment]:
    """The roles node `node_id` holds in `exp` (workers only once it runs), as the node runs them.

    `curve_keys` is `curve_keys(exp, nodes)` when the data plane runs CurveZMQ; `holders` is
    `checkpoint_holders(exp, nodes)`, the sources a restoring shard may fetch checkpoint files from.
    """
    servers = exp.roles_of(pb.ROLE_PARAMETER_SERVER)
    primaries = {r.index: r for r in servers if r.replica == 0}
    backups = {r.index: r for r in servers if r.replica == 1}
    endpoints = {i: r.endpoint for i, r in primaries.items() if r.endpoint}
    workers = exp.roles_of(pb.ROLE_WORKER)
    senders = [f"{w.node_id}:{w.index}" for w in workers]
    peers = {w.index: w.endpoint for w in workers if w.endpoint} if not exp.mode.servers else {}
    server_keys, members, curve_senders = curve_keys
    spec = exp.spec
    epochs = {int(k): v for k, v in exp.shard_epochs.items()}
    out = []
    for r in exp.roles:
        if r.node_id != node_id:
            continue
        if r.role == pb.ROLE_WORKER and exp.state != pb.EXPERIMENT_STATE_RUNNING:
            continue  # workers start once every shard serves
        ps = r.role == pb.ROLE_PARAMETER_SERVER
        backup = backups.get(r.index) if ps and r.replica == 0 else None
        sources = {e: (t, k) for n, (e, t, k) in (holders or {}).items() if n != r.node_id} \
            if ps and r.restore_epoch else {}
        out.append(
            pb.Assignment(
                experiment_id=exp.id,
                role=r.role,
                index=r.index,
                num_workers=len(workers),
                generation=exp.generation,
                experiment_json=exp.spec_json,
                shard_endpoints=endpoints if not ps else {},
                checkpoint_dir=spec.get("checkpoint_dir") or checkpoint_root,
                lead=(not ps and r.node_id == exp.lead_node),
                replica=r.replica,
                backup_endpoint=backup.endpoint if backup and backup.state == pb.ROLE_STATE_SERVING else "",
                workers=senders if ps else [],
                restore_epoch=r.restore_epoch,
                worker_rank=workers.index(r) if not ps else 0,
                peer_endpoints={i: e for i, e in peers.items() if i != r.index} if not ps else {},
                curve_server_keys={**server_keys, **{e: k for e, (_, k) in sources.items() if k}},
                curve_members=members,
                shard_epochs=epochs if not ps else {r.index: epochs.get(r.index, 0)},
                sender_token=token_for(exp.sender_key, f"{r.node_id}:{r.index}") if not ps else "",
                sender_key=exp.sender_key if ps else "",
                curve_senders=curve_senders,
                checkpoint_sources={e: t for e, (t, _) in sources.items()},
            )
        )
    return out


def checkpoint_holders(exp: ExpRec, nodes: Mapping[str, NodeRec]) -> dict[str, tuple[str, str, str]]:
    """Node id -> (file server endpoint, fetch token, CURVE key) of each live node holding `exp`'s shard checkpoints."""
    out = {}
    for node_id in exp.checkpoint_holders:
        n = nodes.get(node_id)
        if n is not None and n.alive and n.checkpoint_endpoint and n.checkpoint_secret:
            out[node_id] = (n.checkpoint_endpoint, fetch_token(n.checkpoint_secret, exp.id), n.checkpoint_key)
    return out


def curve_keys(exp: ExpRec, nodes: Mapping[str, NodeRec]) -> CurveKeys:
    """CurveZMQ: (endpoint -> public key of the node serving it, public keys of the members,
    data-plane sender id -> public key of the node that alone may speak as it).

    Members are the nodes holding a role in `exp` now: a node that is lost, leaves or
    loses its role drops out, and the shards and peers refuse its key from then on. Senders:
    each worker's id (`node_id:index` to shards, its index to gossip peers) and each shard
    primary's `shard-N`, so a member's key speaks only for its own node's roles.
    """
    keys = {r.node_id: nodes[r.node_id].curve_key for r in exp.roles
            if r.node_id in nodes and nodes[r.node_id].curve_key}
    endpoints = {r.endpoint: keys[r.node_id] for r in exp.roles if r.endpoint and r.node_id in keys}
    senders: dict[str, str] = {}
    for r in exp.roles:
        key = keys.get(r.node_id)
        if key is None:
            continue
        if r.role == pb.ROLE_WORKER:
            senders[f"{r.node_id}:{r.index}" if exp.mode.servers else str(r.index)] = key
        elif r.replica == 0:
            senders[primary_sender(r.index)] = key
    return endpoints, sorted(set(keys.values())), senders


def experiment_status(exp: ExpRec, nodes: Mapping[str, NodeRec], rates: Mapping[str, float],
                      slow: set[str]) -> pb.ExperimentStatus:
    """`exp` as clients see it; `rates` and `slow` are its workers' step rates and stragglers."""
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
                node_name=nodes[r.node_id].name if r.node_id in nodes else "",
                role=r.role,
                index=r.index,
                state=r.state,
                endpoint=r.endpoint,
                replica=r.replica,
                step_rate=rates.get(r.node_id, 0.0) if r.role == pb.ROLE_WORKER else 0.0,
                straggler=r.role == pb.ROLE_WORKER and r.node_id in slow,
                replicated=r.role == pb.ROLE_PARAMETER_SERVER and r.replica == 0 and r.replicated,
            )
            for r in exp.roles
        ],
        experiment_json=exp.spec_json,
    )


def node_info(n: NodeRec, exp: ExpRec | None, now: float) -> pb.NodeInfo:
    """Node `n` as clients see it; `exp` is the experiment it works for, if any."""
    role: pb.Role.ValueType = pb.ROLE_UNSPECIFIED
    index = -1
    if exp is not None:
        mine = next((r for r in exp.roles if r.node_id == n.id), None)
        if mine is not None:
            role, index = mine.role, mine.index
    return pb.NodeInfo(
        id=n.id, name=n.name, address=n.address, hostname=n.hostname, spot=n.spot, labels=n.labels,
        cpus=n.cpus, gpus=n.gpus, nproc_per_node=n.nproc_per_node, state=n.state, role=role,
        experiment_id=n.experiment_id, lease_age_s=max(0.0, now - n.last_seen), role_index=index,
    )
