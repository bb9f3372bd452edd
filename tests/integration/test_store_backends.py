"""The store interface on both backends: SQLite (the default) and a real PostgreSQL server; fencing by the leader term."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gossamer.coordinator.pg_store import PgStore
from gossamer.coordinator.records import ExpRec, NodeRec, RoleRec
from gossamer.coordinator.store import Store
from gossamer.core.errors import NotLeaderError

pytestmark = pytest.mark.timeout(300)
T = TypeVar("T")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path) if request.param == "sqlite" else PgStore(request.getfixturevalue("postgres_url"))
    try:
        yield s
    finally:
        s.close()


def _reopen(store: Store, tmp_path: Path) -> Store:
    return PgStore(store.url) if isinstance(store, PgStore) else Store(tmp_path)


def test_nodes_and_experiments_are_upserted_and_load_back(store: Store, tmp_path: Path) -> None:
    node = NodeRec(id="n1", name="a", address="10.0.0.1", labels={"zone": "z1"}, joined_unix=1.5)
    exp = ExpRec(id="e1", seq=1, name="x", spec_json='{"name": "x"}', steps=10,
                 roles=[RoleRec(node_id="n1", role=1, index=0, endpoint="tcp://h:1")])
    _run(store.save_node(node))
    _run(store.save_experiment(exp))
    node.name, exp.steps = "b", 20  # saved again: replaced, not duplicated
    _run(store.save_node(node))
    _run(store.save_experiment(exp))
    _run(store.save_experiment(ExpRec(id="e0", seq=2, name="y", spec_json="{}")))
    store.close()
    again = _reopen(store, tmp_path)
    try:
        nodes, exps = again.load()
        assert [(n.id, n.name, n.labels) for n in nodes] == [("n1", "b", {"zone": "z1"})]
        assert [(e.id, e.steps) for e in exps] == [("e1", 20), ("e0", 0)]  # in submit order (seq)
        assert exps[0].roles[0].endpoint == "tcp://h:1"
    finally:
        again.close()


def test_a_save_queued_after_a_higher_step_count_never_stores_fewer(store: Store, tmp_path: Path) -> None:
    exp = ExpRec(id="e1", seq=1, name="x", spec_json="{}", steps=244)

    async def together() -> None:  # queued in one step: committed in this order, in one transaction
        await asyncio.gather(store.save_experiment(exp, steps=300),  # a report of step 300
                             store.save_experiment(exp, steps=250),  # another worker's, behind it
                             store.save_experiment(exp))  # the record as it stood (244), behind both

    _run(together())
    store.close()
    again = _reopen(store, tmp_path)
    try:
        assert [e.steps for e in again.load()[1]] == [300]
    finally:
        again.close()


def test_events_checkpoints_and_counts(store: Store) -> None:
    _run(store.add_event("join", "node a joined", node_id="n1"))
    _run(store.add_event("running", "go", experiment_id="e1"))
    _run(store.add_checkpoint("e1", 100, "/ck/100", "full"))
    _run(store.add_checkpoint("e1", 200, "/ck/200", "full"))
    assert [e["kind"] for e in _run(store.events())] == ["join", "running"]
    assert [e["message"] for e in _run(store.events("e1"))] == ["go"]
    assert _run(store.latest_checkpoint("e1"))[:3] == (200, "/ck/200", "full")
    assert _run(store.latest_checkpoint("e2")) is None
    assert _run(store.count("events")) == 2 and _run(store.count("checkpoints")) == 2


def _points(n: int, t0: float) -> list[tuple[float, int, str, dict[str, float]]]:
    return [(t0 + i, i, src, {"loss": math.sin(i / 50) + (3 if src == "a" else 0), "step_s": 0.1})
            for i in range(n) for src in ("a", "b")]


def test_metrics_raw_paged_aggregated_downsampled_and_pruned(store: Store) -> None:
    t0 = 1_000_000.0
    _run(store.add_metrics("e1", _points(400, t0)))
    raw = _run(store.metrics("e1"))
    assert len(raw) == 800 and raw[0][:3] == (t0, 0, "a")  # two pages, in time order
    merged, width = _run(store.metric_rows("e1", max_points=40))
    assert width > 0 and 30 <= len(merged) <= 42
    assert all(p[3]["loss"] > 1.5 for p in merged if p[2] == "a")  # per source, never mixed
    page = _run(store.metric_page("e1", 0.0, 40, ""))
    assert page.points and page.points[0].count > 1 and page.points[0].hi["loss"] >= page.points[0].lo["loss"]
    before = _run(store.count("metrics"))
    assert _run(store.downsample_metrics(t0 + 200, 50.0)) == 400  # 200 s from each of two sources
    after = _run(store.metrics("e1"))
    assert _run(store.count("metrics")) == before - 400 + 8  # 4 buckets of 50 s per source
    old = [p for p in after if p[0] < t0 + 200]
    assert len(old) == 8 and all(p[3]["step_s"] == pytest.approx(0.1) for p in old)
    _run(store.add_event("old", "x", experiment_id="e1"))
    _run(store.prune(0.0, ["e1"], []))
    assert _run(store.metrics("e1")) == [] and _run(store.count("events")) == 0


def test_both_backends_answer_the_same_merged_points(postgres_url: str, tmp_path: Path) -> None:
    pg, lite = PgStore(postgres_url), Store(tmp_path)
    try:
        for s in (pg, lite):
            _run(s.add_metrics("e1", _points(700, 5000.0)))
        for max_points in (0, 50, 333):
            a = _run(pg.metric_rows("e1", max_points=max_points, per_source=True))
            b = _run(lite.metric_rows("e1", max_points=max_points, per_source=True))
            assert a[1] == pytest.approx(b[1]) and len(a[0]) == len(b[0])
            for p, q in zip(a[0], b[0], strict=True):
                assert p[:3] == q[:3] and p[3] == pytest.approx(q[3])
    finally:
        pg.close()
        lite.close()


@pytest.fixture
def rivals(postgres_url: str) -> Iterator[tuple[PgStore, PgStore, list[str]]]:
    """Two stores on one database, the first leading (term 1), and what it was told when it lost the lead."""
    a, b = PgStore(postgres_url), PgStore(postgres_url)
    lost: list[str] = []
    try:
        assert _run(a.try_lead("a:1")) == 1
        a.on_lost = lost.append
        yield a, b, lost
    finally:
        a.close()
        b.close()


def test_one_leader_and_a_write_from_an_old_term_is_refused(rivals: tuple[PgStore, PgStore, list[str]]) -> None:
    a, b, lost = rivals
    assert _run(b.try_lead("b:1")) == 0  # the lock is held
    assert _run(b.leader()) == (1, "a:1")
    _run(a.save_node(NodeRec(id="n1", name="x", address="h")))
    # Someone bumps the term behind a's back (an operator, a split brain): a's writes stop.
    b.run_sync(lambda db: db.execute("UPDATE gossamer_leader SET term = term + 1"))
    with pytest.raises(NotLeaderError):
        _run(a.save_node(NodeRec(id="n2", name="y", address="h")))
    assert lost and not _run(a.still_leading())
    assert [n.id for n in b.load()[0]] == ["n1"]  # nothing of the refused write landed


def test_the_lock_passes_when_the_leaders_session_ends(rivals: tuple[PgStore, PgStore, list[str]]) -> None:
    a, b, lost = rivals
    pid = a.run_sync(lambda db: db.execute("SELECT pg_backend_pid()").fetchone()[0])
    b.run_sync(lambda db: db.execute("SELECT pg_terminate_backend(?)", (pid,)))
    with pytest.raises(NotLeaderError):
        _run(a.add_event("x", "after the session ended"))
    assert lost
    assert _run(b.try_lead("b:1")) == 2
    assert _run(b.leader()) == (2, "b:1")
    assert _run(b.events()) == []
