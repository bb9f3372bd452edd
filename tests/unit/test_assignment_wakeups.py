"""Which nodes' assignment streams a coordinator change wakes: only those whose assignments can have changed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.core import Coordinator
from gossamer.v1 import coordinator_pb2 as pb
from tests._fixtures import experiment


def _coordinator(tmp_path: Path) -> Coordinator:
    return Coordinator(CoordinatorConfig(state_dir=str(tmp_path), check_imports=False))


async def _join(c: Coordinator, name: str) -> str:
    return (await c.join(pb.JoinRequest(name=name, address="127.0.0.1"))).node_id


def test_a_join_wakes_no_idle_nodes_stream(tmp_path: Path) -> None:
    async def go() -> None:
        c = _coordinator(tmp_path)
        idle = [await _join(c, f"n{i}") for i in range(3)]
        events = [c.streams.event(n) for n in idle]
        await _join(c, "newcomer")
        assert not any(e.is_set() for e in events)
        c.store.close()

    asyncio.run(go())


def test_nodes_given_roles_are_woken_and_metrics_wake_none(tmp_path: Path) -> None:
    async def go() -> None:
        c = _coordinator(tmp_path)
        nodes = [await _join(c, f"n{i}") for i in range(3)]
        events = {n: c.streams.event(n) for n in nodes}
        exp_id = await c.submit(experiment(mode="async", num_ps_shards=1, min_workers=1, max_workers=1).to_json())
        bound = {r.node_id for r in c.exps[exp_id].roles}
        assert bound and all(events[n].is_set() for n in bound)
        for n in bound:
            c.streams.sent(n, bool(c.assignments_for(n)))
        again = {n: c.streams.event(n) for n in nodes}
        point = pb.MetricPoint(time_unix=1.0, step=1, source="w/0", values={"loss": 1.0})
        await c.report_metrics(pb.ReportMetricsRequest(experiment_id=exp_id, points=[point]))
        assert not any(e.is_set() for e in again.values())
        c.store.close()

    asyncio.run(go())


def test_a_node_that_held_roles_is_woken_when_its_experiment_ends(tmp_path: Path) -> None:
    async def go() -> None:
        c = _coordinator(tmp_path)
        nodes = [await _join(c, f"n{i}") for i in range(3)]
        exp_id = await c.submit(experiment(mode="async", num_ps_shards=1, min_workers=1, max_workers=1).to_json())
        holders = [n for n in nodes if c.assignments_for(n)]
        assert holders
        for n in nodes:
            c.streams.sent(n, bool(c.assignments_for(n)))
        events = {n: c.streams.event(n) for n in holders}
        await c.cancel(exp_id)
        assert all(e.is_set() for e in events.values())
        assert all(c.assignments_for(n) == [] for n in holders)
        c.store.close()

    asyncio.run(go())


def test_a_join_or_leave_wakes_the_role_holders_only_when_it_changes_their_experiment(tmp_path: Path) -> None:
    """A join storm woke every node holding a role at every join: 90 ms of coordinator CPU a join at 100 experiments."""
    async def go() -> None:
        c = _coordinator(tmp_path)
        nodes = [await _join(c, f"n{i}") for i in range(3)]
        exp_id = await c.submit(experiment(mode="async", num_ps_shards=1, min_workers=1, max_workers=3).to_json())
        exp = c.exps[exp_id]
        assert len(exp.roles_of(pb.ROLE_WORKER)) == 2  # one node each, beside the shard's primary
        for r in exp.roles_of(pb.ROLE_PARAMETER_SERVER):
            await c.report_role(pb.ReportRoleRequest(
                node_id=r.node_id, experiment_id=exp_id, role=r.role, index=r.index, state=pb.ROLE_STATE_SERVING,
                endpoint=f"tcp://127.0.0.1:{5000 + r.replica}", replica=r.replica, replicated=r.replica == 0))
        assert exp.state == pb.EXPERIMENT_STATE_RUNNING
        for n in nodes:
            c.streams.sent(n, bool(c.assignments_for(n)))
        holders = {n: c.streams.event(n) for n in nodes}
        grown = await _join(c, "grown")  # max_workers 3: it becomes the third worker
        assert c.assignments_for(grown) and all(e.is_set() for e in holders.values())
        for n in [*nodes, grown]:
            c.streams.sent(n, bool(c.assignments_for(n)))
        holders = {n: c.streams.event(n) for n in [*nodes, grown]}
        spare = await _join(c, "spare")  # the experiment is full: nothing changed for anyone
        assert not c.assignments_for(spare)
        assert not any(e.is_set() for e in holders.values())
        await c.leave(spare, "churn")  # nor when a node without roles leaves
        assert not any(e.is_set() for e in holders.values())
        await c.leave(grown, "churn")  # a worker leaving changes its experiment
        assert all(e.is_set() for n, e in holders.items() if n != grown)
        c.store.close()

    asyncio.run(go())


def test_a_role_report_wakes_only_its_own_experiments_nodes(tmp_path: Path) -> None:
    """At 100 experiments every report woke every role holder (400 streams a report)."""
    async def go() -> None:
        c = _coordinator(tmp_path)
        nodes = [await _join(c, f"n{i}") for i in range(6)]
        spec = {"mode": "async", "num_ps_shards": 1, "min_workers": 1, "max_workers": 1}
        first, second = [await c.submit(experiment(name=f"e{k}", **spec).to_json()) for k in range(2)]
        for n in nodes:
            c.streams.sent(n, bool(c.assignments_for(n)))
        events = {n: c.streams.event(n) for n in nodes}
        primary = next(r for r in c.exps[first].roles if r.role == pb.ROLE_PARAMETER_SERVER and r.replica == 0)
        await c.report_role(pb.ReportRoleRequest(node_id=primary.node_id, experiment_id=first, role=primary.role,
                                                 index=0, state=pb.ROLE_STATE_SERVING, endpoint="tcp://127.0.0.1:5000"))
        mine = {r.node_id for r in c.exps[first].roles}
        theirs = {r.node_id for r in c.exps[second].roles} - mine
        assert mine and theirs
        assert all(events[n].is_set() for n in mine) and not any(events[n].is_set() for n in theirs)
        c.store.close()

    asyncio.run(go())
