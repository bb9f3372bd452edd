"""The store's group commit (coordinator/group_commit.py) on a real SQLite file: grouped, answered in order, durable, one bad write fails alone."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest

from gossamer.coordinator.records import NodeRec
from gossamer.coordinator.store import Store


def test_writes_asked_together_commit_as_one_transaction_and_are_answered_in_order(tmp_path: Path) -> None:
    answered: list[int] = []

    async def one(store: Store, k: int) -> None:
        await store.add_event("join", f"node {k}", node_id=f"n{k}")
        answered.append(k)

    async def run() -> None:
        store = Store(tmp_path)
        try:
            await asyncio.gather(*(one(store, k) for k in range(50)))
            assert (store.commits.batches, store.commits.writes) == (1, 50)
        finally:
            store.close()

    asyncio.run(run())
    assert answered == list(range(50))
    reopened = Store(tmp_path)
    try:
        rows = asyncio.run(reopened.events())
        assert [r["node_id"] for r in rows] == [f"n{k}" for k in range(50)]  # committed, in the order asked
    finally:
        reopened.close()


def test_a_statement_runs_after_every_write_asked_before_it(tmp_path: Path) -> None:
    """A read sent while one batch is at the thread and another waits must see both: the queue goes first."""
    async def run() -> list[str]:
        store = Store(tmp_path)
        hold = threading.Event()
        try:
            held = asyncio.create_task(store.run(lambda db: hold.wait(10)))  # the store's thread is busy
            first = asyncio.create_task(store.add_event("a", "first"))
            for _ in range(3):
                await asyncio.sleep(0)  # `first` is sent to the thread (queued behind `held`)
            second = asyncio.create_task(store.add_event("b", "second"))
            for _ in range(3):
                await asyncio.sleep(0)  # `second` waits: a batch is at the thread
            read = asyncio.create_task(store.events())
            await asyncio.sleep(0)
            hold.set()
            await asyncio.gather(held, first, second)
            return [r["kind"] for r in await read]
        finally:
            hold.set()
            store.close()

    assert asyncio.run(run()) == ["a", "b"]


def test_a_failing_write_fails_only_its_caller_and_the_others_are_durable(tmp_path: Path) -> None:
    async def run() -> list[BaseException | None]:
        store = Store(tmp_path)
        try:
            return await asyncio.gather(
                store.save_node(NodeRec(id="n1", name="a", address="127.0.0.1")),
                store.add_metrics("e", [(math.nan, 1, "s", {})]),  # NOT NULL: the batch is rolled back
                store.add_metrics("e", [(1.0, 2, "s", {"x": 1.0})]),
                store.save_node(NodeRec(id="n2", name="b", address="127.0.0.1")),
                return_exceptions=True)
        finally:
            store.close()

    outcomes = asyncio.run(run())
    assert [type(o).__name__ for o in outcomes] == ["NoneType", "IntegrityError", "NoneType", "NoneType"]
    reopened = Store(tmp_path)
    try:
        assert sorted(n.id for n in reopened.load()[0]) == ["n1", "n2"]
        assert [s for _, s, _, _ in asyncio.run(reopened.metrics("e"))] == [2]
    finally:
        reopened.close()


@pytest.mark.parametrize("count", [1, 3])
def test_the_queue_keeps_working_across_event_loops(tmp_path: Path, count: int) -> None:
    """A store used from one asyncio.run after another (tools, tests) still commits."""
    store = Store(tmp_path)
    try:
        for k in range(count):
            asyncio.run(store.save_node(NodeRec(id=f"n{k}", name="x", address="127.0.0.1")))
        assert asyncio.run(store.count("nodes")) == count
    finally:
        store.close()
