"""The coordinator's persistence (nodes, experiments, metrics, checkpoints, events): the store interface, on SQLite (WAL).

The PostgreSQL backend (`pg_store.PgStore`, `--state postgresql://...`) subclasses `Store`: the
same methods over a connection that speaks sqlite3's `execute`/`executemany`, and its own SQL
where the dialects differ (the class attributes below).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gossamer.coordinator import metric_query
from gossamer.coordinator.group_commit import GroupCommit
from gossamer.coordinator.records import ExpRec, NodeRec
from gossamer.coordinator.sql import Db

log = logging.getLogger(__name__)
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS experiments (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS metrics (
  id INTEGER PRIMARY KEY AUTOINCREMENT, experiment_id TEXT NOT NULL, time REAL NOT NULL,
  step INTEGER NOT NULL, source TEXT NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS metrics_by_exp ON metrics (experiment_id, time);
CREATE INDEX IF NOT EXISTS metrics_by_time ON metrics (time);
CREATE TABLE IF NOT EXISTS checkpoints (
  experiment_id TEXT NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL, kind TEXT NOT NULL,
  time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, experiment_id TEXT NOT NULL,
  node_id TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL);
"""


class Store:
    """One SQLite file; every statement runs on one dedicated thread, off the event loop.

    Single-statement writes (nodes, experiments, events, metrics, checkpoints) are group-committed
    (`group_commit.py`): those asked for while a transaction is at the thread share the next one.
    """

    #: Where the state lives, for logs and the status page.
    location: str
    _closed = False
    _UPSERT_NODE = "INSERT OR REPLACE INTO nodes VALUES (?, ?)"
    _UPSERT_EXPERIMENT = "INSERT OR REPLACE INTO experiments VALUES (?, ?, ?)"

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "coordinator.sqlite"
        self.location = str(self.path)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gossamer-store")
        self._db: Db | None = None
        self.commits = GroupCommit(self._pool, lambda: self._db)
        self._steps_queued: dict[str, int] = {}
        self._pool.submit(self._open).result()

    def _open(self) -> None:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        metric_query.migrate(db)
        self._db = db

    async def run(self, fn: Callable[[Db], T]) -> T:
        """`fn` on the store's thread, after every write queued before it."""
        db = self._db
        assert db is not None
        self.commits.flush()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, db)

    async def write(self, fn: Callable[[Db], object]) -> None:
        """`fn`'s statements, committed in a transaction shared with the writes queued alongside (group commit)."""
        await self.commits.write(fn)

    def run_sync(self, fn: Callable[[Db], T]) -> T:
        """`run` from outside the event loop (startup, before it serves)."""
        assert self._db is not None
        return self._pool.submit(fn, self._db).result()

    def close(self) -> None:
        """Close the connection; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._db is not None:
            self.commits.flush()  # queued writes commit before the connection closes

        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._pool.submit(_close).result()
        self._pool.shutdown()

    # --- loading (startup, before the loop serves) ----------------------------------------
    def load(self) -> tuple[list[NodeRec], list[ExpRec]]:
        def _load(db: Db) -> tuple[list[NodeRec], list[ExpRec]]:
            nodes = [NodeRec.from_json(r[0]) for r in db.execute("SELECT data FROM nodes")]
            exps = [
                ExpRec.from_json(r[0])
                for r in db.execute("SELECT data FROM experiments ORDER BY seq")
            ]
            return nodes, exps

        return self.run_sync(_load)

    # --- writes ---------------------------------------------------------------------------
    async def save_node(self, node: NodeRec) -> None:
        data = node.to_json()
        await self.write(lambda db: db.execute(self._UPSERT_NODE, (node.id, data)))

    async def save_experiment(self, exp: ExpRec, steps: int | None = None) -> None:
        """Store `exp` (with `steps` as its step count where given: the caller shows it once stored).

        The stored count never goes back: writes commit in the order they are queued, and one
        queued after a report of step N (a lower report, a save of the record as it stood before
        N was shown) carries N too. Without this, a status said 300 steps and a new leader read 244.
        """
        steps = max(exp.steps if steps is None else steps, self._steps_queued.get(exp.id, 0))
        self._steps_queued[exp.id] = steps
        data = dataclasses.replace(exp, steps=steps).to_json()
        await self.write(lambda db: db.execute(self._UPSERT_EXPERIMENT, (exp.id, exp.seq, data)))

    async def add_metrics(self, exp_id: str, rows: list[tuple[float, int, str, dict[str, float]]]) -> None:
        params = [(exp_id, t, step, src, json.dumps(vals)) for t, step, src, vals in rows]
        # In a transaction (group_commit), rolled back whole if a row fails.
        await self.write(lambda db: db.executemany(
            "INSERT INTO metrics (experiment_id, time, step, source, data) VALUES (?,?,?,?,?)", params))

    async def metrics(self, exp_id: str, since: float = 0.0, max_points: int = 0,
                      per_source: bool = False) -> list[tuple[float, int, str, dict[str, Any]]]:
        """Every page of `exp_id`'s points after `since`, merged to about `max_points` (0: the
        default; per source with `per_source`)."""
        return (await self.metric_rows(exp_id, since, max_points, per_source))[0]

    async def metric_rows(self, exp_id: str, since: float = 0.0, max_points: int = 0, per_source: bool = False,
                          ) -> tuple[list[tuple[float, int, str, dict[str, Any]]], float]:
        """`metrics`, and the width of the buckets points were merged into (0: as reported)."""
        rows: list[tuple[float, int, str, dict[str, Any]]] = []
        token = ""
        while True:
            page = await self.run(lambda db, t=token: metric_query.read_page(  # type: ignore[misc]
                db, exp_id, since, max_points, t, per_source))
            rows.extend((p.time, p.step, p.source, p.values) for p in page.points)
            token = page.next_token
            if not token:
                return rows, page.bucket_s

    async def metric_page(self, exp_id: str, since: float, max_points: int, token: str) -> metric_query.Page:
        """One page of points (see metric_query.read_page)."""
        return await self.run(lambda db: metric_query.read_page(db, exp_id, since, max_points, token))

    async def downsample_metrics(self, before: float, bucket_s: float) -> int:
        """Merge points reported before `before` into `bucket_s` buckets; rows merged (all of them)."""
        total = 0
        while merged := await self.run(lambda db: metric_query.downsample(db, before, bucket_s)):
            total += merged
        return total

    async def prune(self, events_before: float, experiments: list[str], nodes: list[str]) -> None:
        """Delete events older than `events_before`, and everything of `experiments` and `nodes`."""
        def _prune(db: Db) -> None:
            db.execute("BEGIN")
            try:
                db.execute("DELETE FROM events WHERE time < ?", (events_before,))
                for table in ("experiments", "metrics", "checkpoints", "events"):
                    key = "id" if table == "experiments" else "experiment_id"
                    db.executemany(f"DELETE FROM {table} WHERE {key}=?", [(e,) for e in experiments])
                db.executemany("DELETE FROM nodes WHERE id=?", [(n,) for n in nodes])
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

        await self.run(_prune)

    async def count(self, table: str) -> int:
        """Rows in `table` (tests and /metrics)."""
        if table not in ("nodes", "experiments", "metrics", "checkpoints", "events"):
            raise ValueError(f"no table {table!r}")
        return int(await self.run(lambda db: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]))  # noqa: S608

    async def add_event(self, kind: str, message: str, experiment_id: str = "", node_id: str = "") -> None:
        log.info("event %s: %s", kind, message)
        now = time.time()
        await self.write(lambda db: db.execute(
            "INSERT INTO events (time, experiment_id, node_id, kind, message) VALUES (?,?,?,?,?)",
            (now, experiment_id, node_id, kind, message)))

    async def events(self, experiment_id: str | None = None, since: float = 0.0) -> list[dict[str, Any]]:
        def _q(db: Db) -> list[dict[str, Any]]:
            sql = "SELECT time, experiment_id, node_id, kind, message FROM events WHERE time >= ?"
            args: tuple[Any, ...] = (since,)
            if experiment_id is not None:
                sql += " AND experiment_id=?"
                args = (since, experiment_id)
            cur = db.execute(sql + " ORDER BY id", args)
            keys = ("time", "experiment_id", "node_id", "kind", "message")
            return [dict(zip(keys, row, strict=True)) for row in cur]

        return await self.run(_q)

    async def add_checkpoint(self, exp_id: str, step: int, path: str, kind: str) -> float:
        now = time.time()
        await self.write(lambda db: db.execute("INSERT INTO checkpoints VALUES (?,?,?,?,?)",
                                               (exp_id, step, path, kind, now)))
        return now

    async def latest_checkpoint(self, exp_id: str) -> tuple[int, str, str, float] | None:
        def _q(db: Db) -> tuple[int, str, str, float] | None:
            return db.execute(
                "SELECT step, path, kind, time FROM checkpoints WHERE experiment_id=? "
                "ORDER BY step DESC, time DESC LIMIT 1",
                (exp_id,),
            ).fetchone()

        return await self.run(_q)
