"""Placement across failure domains (node labels zone and rack): a shard's replicas never share one when they need not."""

from __future__ import annotations

from gossamer.coordinator.placement import place, replica_host, shard_host
from gossamer.coordinator.records import NodeRec, RoleRec
from gossamer.v1 import coordinator_pb2 as pb


def _node(i: int, zone: str = "", rack: str = "", spot: bool = False) -> NodeRec:
    labels = {k: v for k, v in (("zone", zone), ("rack", rack)) if v}
    return NodeRec(id=f"n{i}", name=f"n{i}", address="127.0.0.1", spot=spot, joined_unix=float(i), labels=labels)


def test_a_backup_goes_to_another_zone_even_when_a_server_node_in_the_primarys_zone_is_free() -> None:
    primary, same_zone_server, other_zone_free = _node(0, "a"), _node(1, "a"), _node(2, "b")
    host = replica_host(avoid={"n0"}, servers=[primary, same_zone_server], free=[other_zone_free], workers=[],
                        replicas=[primary])
    assert host is other_zone_free


def test_a_backup_shares_the_primarys_zone_only_when_no_other_zone_has_room() -> None:
    primary, same_zone = _node(0, "a"), _node(1, "a")
    busy_elsewhere = _node(2, "b")
    host = replica_host(avoid={"n0", "n2"}, servers=[primary, busy_elsewhere], free=[same_zone], workers=[],
                        replicas=[primary, busy_elsewhere])
    assert host is same_zone


def test_within_a_zone_a_backup_prefers_another_rack() -> None:
    primary = _node(0, "a", "r1")
    same_rack, other_rack = _node(1, "a", "r1"), _node(5, "a", "r2")
    host = replica_host(avoid={"n0"}, servers=[primary], free=[same_rack, other_rack], workers=[], replicas=[primary])
    assert host is other_rack


def test_unlabelled_nodes_keep_the_old_order_server_then_free_then_worker() -> None:
    nodes = [_node(i) for i in range(4)]
    host = replica_host(avoid={"n0"}, servers=[nodes[0], nodes[3]], free=[nodes[1]], workers=[nodes[2]],
                        replicas=[nodes[0]])
    assert host is nodes[3]


def test_shard_host_places_the_backup_of_each_shard_outside_its_primarys_zone() -> None:
    nodes = {n.id: n for n in (_node(0, "a"), _node(1, "b"), _node(2, "a"), _node(3, "b"))}
    roles = [RoleRec(node_id="n0", role=pb.ROLE_PARAMETER_SERVER, index=0, state=pb.ROLE_STATE_SERVING),
             RoleRec(node_id="n1", role=pb.ROLE_PARAMETER_SERVER, index=1, state=pb.ROLE_STATE_SERVING)]
    free = [nodes["n2"], nodes["n3"]]
    for index, primary in ((0, "n0"), (1, "n1")):
        host = shard_host(roles, index, nodes, free)
        assert host is not None and host.labels["zone"] != nodes[primary].labels["zone"]


def test_shard_primaries_are_spread_over_zones_on_demand_nodes_first() -> None:
    free = [_node(0, "a"), _node(1, "a"), _node(2, "a"), _node(3, "b"), _node(4, "c", spot=True), _node(5, "b")]
    p = place(free, num_servers=3, min_workers=1, max_workers=1)
    assert p is not None
    assert [n.id for n in p.servers] == ["n0", "n3", "n1"]  # zones a, b, a: the spot node in c trains
    assert [n.labels["zone"] for n in p.servers].count("a") == 2
