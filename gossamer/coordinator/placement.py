"""Placement: which nodes host an experiment's shards, their backups and its workers (pure logic over records)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gossamer.coordinator.records import NodeRec, RoleRec
from gossamer.core.modes import Mode
from gossamer.v1 import coordinator_pb2 as pb


@dataclass(frozen=True)
class Placement:
    """Nodes chosen for an experiment: `servers[i]` hosts shard i; `workers` train."""

    servers: list[NodeRec]
    workers: list[NodeRec]


def _server_preference(node: NodeRec) -> tuple[bool, bool, float, str]:
    # On-demand nodes first (a preempted shard costs more than a preempted worker), then nodes
    # without GPUs (a shard only decodes and applies: a GPU node hosting one leaves its GPUs idle),
    # then the longest-lived node, which has shown it stays.
    return (node.spot, node.gpus > 0, node.joined_unix, node.id)


def _worker_preference(node: NodeRec) -> tuple[bool, bool, float, str]:
    # GPU nodes train first; then spot nodes, so that an on-demand node left over can hold a
    # shard's backup; then the longest-lived.
    return (node.gpus == 0, not node.spot, node.joined_unix, node.id)


def free_nodes(nodes: Iterable[NodeRec]) -> list[NodeRec]:
    """Live nodes with no experiment: what placement may use."""
    return [n for n in nodes if n.alive and not n.experiment_id]


def enough(free: int, *, num_servers: int, min_workers: int) -> bool:
    """Whether `free` nodes can start an experiment (`place`'s one condition, so the wait reason agrees)."""
    return free >= num_servers + min_workers


@dataclass(frozen=True)
class Census:
    """The live and free nodes at one moment: one reconcile pass takes it once for all its queued experiments
    (each one's wait reason listed every node: O(queued x nodes) a join in a storm)."""

    live: int
    free: list[NodeRec]
    spot: int  # of the free ones

    @classmethod
    def of(cls, nodes: Iterable[NodeRec]) -> Census:
        live = [n for n in nodes if n.alive]
        free = free_nodes(live)
        return cls(live=len(live), free=free, spot=sum(n.spot for n in free))


def place(
    free: list[NodeRec], *, num_servers: int, min_workers: int, max_workers: int
) -> Placement | None:
    """Choose servers and workers among `free` nodes, or None if there are too few."""
    if not enough(len(free), num_servers=num_servers, min_workers=min_workers):
        return None
    by_pref = sorted(free, key=_server_preference)
    servers = spread_servers(by_pref, num_servers)
    chosen = {n.id for n in servers}
    rest = sorted((n for n in free if n.id not in chosen), key=_worker_preference)
    return Placement(servers=servers, workers=rest[:max_workers])


def place_experiment(free: list[NodeRec], spec: dict[str, Any], mode: Mode) -> Placement | None:
    """Where a queued experiment starts: its shards (none in a mode without servers) and workers."""
    shards, workers = nodes_needed(spec, mode)
    return place(free, num_servers=shards, min_workers=workers, max_workers=spec["max_workers"])


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def nodes_needed(spec: dict[str, Any], mode: Mode) -> tuple[int, int]:
    """(shards, workers): the nodes an experiment needs before it can start (`place_experiment`'s rule)."""
    return (spec["num_ps_shards"] if mode.servers else 0), spec["min_workers"]


def wait_reason(nodes: Iterable[NodeRec] | Census, spec: dict[str, Any], mode: Mode) -> str:
    """Why a queued experiment cannot start on `nodes` now, in words; "" when `place_experiment` would place it.

    Derived from the placer itself, so the message never disagrees with it: e.g. "waiting for 5
    nodes (2 for shards, on-demand preferred; 3 for workers); 3 free (1 on-demand, 2 spot); the
    cluster has 3 live nodes: 2 more must join".
    """
    census = nodes if isinstance(nodes, Census) else Census.of(nodes)
    shards, workers = nodes_needed(spec, mode)
    free = len(census.free)
    if enough(free, num_servers=shards, min_workers=workers):
        return ""
    need = shards + workers
    wants = (f"{shards} for shards, on-demand preferred; " if shards else "") + f"{workers} for workers"
    have = f"{free} free ({free - census.spot} on-demand, {census.spot} spot)"
    busy = census.live - free
    if busy:
        have += f", {busy} busy with other experiments"
    text = f"waiting for {_count(need, 'node')} ({wants}); {have}"
    if census.live < need:
        text += f"; the cluster has {_count(census.live, 'live node')}: {need - census.live} more must join"
    return text


def queued_message(nodes: Iterable[NodeRec] | Census, spec: dict[str, Any], mode: Mode, head: str) -> str:
    """A queued experiment's status message: its `wait_reason`, behind the queue's head `head` if any."""
    why = wait_reason(nodes, spec, mode)
    if head:
        why = f"queued behind {head}" + (f"; {why}" if why else ", which waits for nodes")
    return why


def cluster_too_small(nodes: Iterable[NodeRec], spec: dict[str, Any], mode: Mode) -> bool:
    """Fewer live nodes than the experiment needs, busy or not: it cannot start until more join."""
    return sum(n.alive for n in nodes) < sum(nodes_needed(spec, mode))


def grow(free: list[NodeRec], *, current_workers: int, max_workers: int) -> list[NodeRec]:
    """Free nodes to add as workers to a running experiment (up to `max_workers`)."""
    room = max(0, max_workers - current_workers)
    # GPU nodes first, then the longest-lived; full: no sort per join.
    return sorted(free, key=lambda n: (n.gpus == 0, n.joined_unix, n.id))[:room] if room else []


#: Node labels naming failure domains, widest first: a shard's replicas avoid sharing any of them.
FAILURE_DOMAINS = ("zone", "rack")


def shared_domains(node: NodeRec, others: Iterable[NodeRec]) -> tuple[bool, ...]:
    """For each of FAILURE_DOMAINS: whether `node` shares it with one of `others` (an unlabelled node shares none)."""
    return tuple(
        bool(node.labels.get(key)) and any(o.labels.get(key) == node.labels[key] for o in others)
        for key in FAILURE_DOMAINS
    )


def replica_host(
    *, avoid: set[str], servers: list[NodeRec], free: list[NodeRec], workers: list[NodeRec],
    replicas: Sequence[NodeRec] = (),
) -> NodeRec | None:
    """Where a shard replica goes, given the nodes holding its other `replicas`.

    Never a node in `avoid` (the nodes already holding a replica of that shard). Failure
    domains first: a node in another zone than every replica whenever one has room, then
    another rack; within that, another server node, else a free node, else a worker node;
    on-demand, long-lived nodes first within each group.
    """
    best: tuple[tuple[bool, ...], int, tuple[bool, bool, float, str]] | None = None
    chosen: NodeRec | None = None
    for rank, group in enumerate((servers, free, workers)):
        for n in group:
            if n.id in avoid or not n.alive:
                continue
            key = (shared_domains(n, replicas), rank, _server_preference(n))
            if best is None or key < best:
                best, chosen = key, n
    return chosen


def spread_servers(by_pref: list[NodeRec], count: int) -> list[NodeRec]:
    """`count` shard hosts from `by_pref` (best first): on-demand before spot as before, and within each, zones
    taken in turn so that the loss of one zone takes as few primaries as it can."""
    out: list[NodeRec] = []
    for spot in (False, True):
        zones: dict[str, list[NodeRec]] = {}
        for n in by_pref:
            if n.spot == spot:
                zones.setdefault(n.labels.get(FAILURE_DOMAINS[0], ""), []).append(n)
        queues = list(zones.values())
        while len(out) < count and any(queues):
            for q in queues:
                if q and len(out) < count:
                    out.append(q.pop(0))
    return out


def shard_host(roles: Sequence[RoleRec], index: int, nodes: Mapping[str, NodeRec],
               free: list[NodeRec]) -> NodeRec | None:
    """The node for a new replica of shard `index` of an experiment with `roles` (`replica_host`)."""
    mine = [r for r in roles if r.role == pb.ROLE_PARAMETER_SERVER and r.index == index]
    avoid = {r.node_id for r in mine}
    servers = [nodes[r.node_id] for r in roles if r.role == pb.ROLE_PARAMETER_SERVER and r.node_id in nodes]
    workers = [nodes[r.node_id] for r in roles if r.role == pb.ROLE_WORKER and r.node_id in nodes]
    replicas = [nodes[r.node_id] for r in mine if r.node_id in nodes]
    return replica_host(avoid=avoid, servers=servers, free=free, workers=workers, replicas=replicas)


def lead_node(roles: Sequence[RoleRec]) -> str:
    """The node of the lowest-indexed worker (it evaluates and saves the model), "" without workers."""
    workers = sorted((r for r in roles if r.role == pb.ROLE_WORKER), key=lambda r: r.index)
    return workers[0].node_id if workers else ""


def shards_ready(roles: Sequence[RoleRec], num_shards: int) -> bool:
    """Every shard has a primary, every replica serves, and every primary with a backup is synced to it."""
    servers = [r for r in roles if r.role == pb.ROLE_PARAMETER_SERVER]
    primaries = [r for r in servers if r.replica == 0]
    return (
        len(primaries) == num_shards
        and all(r.state == pb.ROLE_STATE_SERVING and r.endpoint for r in servers)
        and all(r.replicated for r in primaries if any(b.replica == 1 and b.index == r.index for b in servers))
    )


def missing_shards(roles: Sequence[RoleRec], num_shards: int) -> list[int]:
    """Shards with no primary: every replica was lost and no node could host a restore yet."""
    primaries = {r.index for r in roles if r.role == pb.ROLE_PARAMETER_SERVER and r.replica == 0}
    return [i for i in range(num_shards) if i not in primaries]


def waiting_for(roles: Sequence[RoleRec], num_shards: int) -> str:
    """What a running experiment waits for before it can go on ("" when nothing): hosts for shards, a worker."""
    needs = []
    if missing := missing_shards(roles, num_shards):
        needs.append(f"a node to host shard{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                     "(restored from the newest checkpoint)")
    if not any(r.role == pb.ROLE_WORKER for r in roles):
        needs.append("a node to run a worker")
    return " and ".join(needs)


def overdue(since: float, *, now: float, timeout_s: float) -> bool:
    """Whether a wait that began at `since` (0: none under way) has lasted `timeout_s` by `now`."""
    return bool(since) and now - since >= timeout_s


@dataclass(frozen=True, kw_only=True)
class StartOverdue:
    """STARTING outlasted its deadline: run without `backups` (never synced) or, with a `reason`, fail."""

    backups: tuple[RoleRec, ...] = ()
    reason: str = ""


def start_overdue(roles: Sequence[RoleRec], num_shards: int, *, since: float, now: float,
                  timeout_s: float) -> StartOverdue | None:
    """What to do with an experiment STARTING since `since` at `now` (None: wait on).

    Once `timeout_s` has passed: every primary serves, so it runs without the backups that
    have not synced; or a primary does not serve, so it fails naming the shards.
    """
    if not overdue(since, now=now, timeout_s=timeout_s):
        return None
    servers = [r for r in roles if r.role == pb.ROLE_PARAMETER_SERVER]
    serving = {r.index for r in servers if r.replica == 0 and r.state == pb.ROLE_STATE_SERVING and r.endpoint}
    if down := [i for i in range(num_shards) if i not in serving]:
        return StartOverdue(reason=f"did not start within {timeout_s:g} s (start_timeout_s): shard"
                                   f"{'s' if len(down) > 1 else ''} {', '.join(map(str, down))} not serving")
    synced = {r.index for r in servers if r.replica == 0 and r.replicated}
    return StartOverdue(backups=tuple(r for r in servers if r.replica == 1 and r.index not in synced))
