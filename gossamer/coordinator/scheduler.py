"""Role assignment: which free nodes host parameter-server shards and which train (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass

from gossamer.coordinator.records import NodeRec


@dataclass(frozen=True)
class Placement:
    """Nodes chosen for an experiment: `servers[i]` hosts shard i; `workers` train."""

    servers: list[NodeRec]
    workers: list[NodeRec]


def _server_preference(node: NodeRec) -> tuple[bool, float, str]:
    # On-demand nodes first (a preempted shard costs more than a preempted worker), then
    # the longest-lived node, which has shown it stays.
    return (node.spot, node.joined_unix, node.id)


def place(
    free: list[NodeRec], *, num_servers: int, min_workers: int, max_workers: int
) -> Placement | None:
    """Choose servers and workers among `free` nodes, or None if there are too few."""
    if len(free) < num_servers + min_workers:
        return None
    by_pref = sorted(free, key=_server_preference)
    servers = by_pref[:num_servers]
    chosen = {n.id for n in servers}
    # Spot nodes train first: an on-demand node left over can hold a shard's backup.
    rest = sorted((n for n in free if n.id not in chosen), key=lambda n: (not n.spot, n.joined_unix, n.id))
    return Placement(servers=servers, workers=rest[:max_workers])


def grow(free: list[NodeRec], *, current_workers: int, max_workers: int) -> list[NodeRec]:
    """Free nodes to add as workers to a running experiment (up to `max_workers`)."""
    room = max(0, max_workers - current_workers)
    return sorted(free, key=lambda n: (n.joined_unix, n.id))[:room]


def replica_host(
    *, avoid: set[str], servers: list[NodeRec], free: list[NodeRec], workers: list[NodeRec]
) -> NodeRec | None:
    """Where a shard replica goes: another server node, else a free node, else a worker node.

    On-demand, long-lived nodes first within each group; never a node in `avoid` (the
    nodes already holding a replica of that shard), so the two replicas never share a fate.
    """
    for group in (servers, free, workers):
        candidates = [n for n in group if n.id not in avoid and n.alive]
        if candidates:
            return sorted(candidates, key=_server_preference)[0]
    return None
