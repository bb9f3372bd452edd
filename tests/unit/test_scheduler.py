"""Role placement: servers prefer on-demand, long-lived nodes; workers fill the rest."""

from __future__ import annotations

from gossamer.coordinator.placement import grow, place
from gossamer.coordinator.records import NodeRec


def _node(i: int, spot: bool) -> NodeRec:
    return NodeRec(id=f"n{i}", name=f"n{i}", address="127.0.0.1", spot=spot, joined_unix=float(i))


def test_servers_avoid_spot_nodes() -> None:
    nodes = [_node(0, True), _node(1, True), _node(2, False), _node(3, True), _node(4, False)]
    p = place(nodes, num_servers=2, min_workers=3, max_workers=8)
    assert p is not None
    assert [n.id for n in p.servers] == ["n2", "n4"]
    assert [n.id for n in p.workers] == ["n0", "n1", "n3"]


def test_spot_nodes_host_servers_when_nothing_else() -> None:
    p = place([_node(i, True) for i in range(3)], num_servers=1, min_workers=2, max_workers=2)
    assert p is not None and [n.id for n in p.servers] == ["n0"]


def test_too_few_nodes_waits() -> None:
    assert place([_node(0, False), _node(1, True)], num_servers=2, min_workers=1, max_workers=4) is None


def test_max_workers_caps_placement_and_growth() -> None:
    p = place([_node(i, False) for i in range(6)], num_servers=1, min_workers=1, max_workers=2)
    assert p is not None and len(p.workers) == 2
    assert len(grow([_node(7, True), _node(8, True)], current_workers=2, max_workers=3)) == 1
    assert grow([_node(7, True)], current_workers=3, max_workers=3) == []


def test_spot_nodes_train_first_and_replicas_never_share_a_node() -> None:
    from gossamer.coordinator.placement import place, replica_host
    from gossamer.coordinator.records import NodeRec

    nodes = [NodeRec(id=f"n{i}", name=f"n{i}", address="x", spot=i >= 2, joined_unix=float(i)) for i in range(5)]
    p = place(nodes, num_servers=1, min_workers=2, max_workers=3)
    assert p is not None and [n.id for n in p.servers] == ["n0"]
    assert [n.id for n in p.workers] == ["n2", "n3", "n4"]  # on-demand n1 stays free for a backup
    free = [nodes[1]]
    assert replica_host(avoid={"n0"}, servers=[nodes[0]], free=free, workers=p.workers).id == "n1"
    assert replica_host(avoid={"n0"}, servers=[nodes[0]], free=[], workers=p.workers).id == "n2"
    assert replica_host(avoid={"n0", "n2", "n3", "n4"}, servers=[nodes[0]], free=[], workers=p.workers) is None
