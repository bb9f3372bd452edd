"""Group commit for the store: writes queued while the store's thread is busy go in one transaction, each caller answered once it is committed.

A join storm made every Join wait for two statements of its own, each a round trip through the
store's single thread and a commit: the event loop and that thread handed the GIL back and
forth per statement, and joins queued behind each other (1,000 offered a second, about 260
served on the benchmark machine). Here a write waits in a queue until the end of the event
loop's current step; then, if no batch is at the store's thread, everything queued goes there
as one transaction; if one is, the queue goes as the next transaction when it is done. Under
a storm, a transaction carries the writes of every join that arrived meanwhile; alone, a write
goes at once, as before.

Order: batches go to the store's thread (one thread, first in first out) in the order they
were queued, and a direct statement (`Store.run`, a read or a multi-statement write) sends the
queue ahead of itself, so every statement runs in the order it was asked for.

Durability: a caller's await returns only after the transaction holding its write committed
(SQLite WAL: in the file, so a kill -9 of the coordinator keeps it; PostgreSQL: its commit).
When a batch fails, it is rolled back and its writes are run again one by one, so one bad
write fails only its own caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from gossamer.coordinator.sql import Db

log = logging.getLogger(__name__)

Write = Callable[[Db], object]


class GroupCommit:
    """The write queue of one store: its thread (`pool`, one worker) and connection (`db()`)."""

    def __init__(self, pool: Executor, db: Callable[[], Db | None]) -> None:
        self._pool = pool
        self._db = db
        self._queued: list[tuple[Write, asyncio.Future[None]]] = []
        self._in_flight = 0  # batches at the store's thread
        self._kick_due = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the two above belong to
        #: Transactions committed and writes they carried (for tests and the benchmark).
        self.batches = 0
        self.writes = 0

    def write(self, fn: Write) -> asyncio.Future[None]:
        """Queue `fn` (statements on the connection); the future is done once they are committed."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a store used from one asyncio.run after another (tools, tests)
            self._loop, self._in_flight, self._kick_due = loop, 0, False
        fut: asyncio.Future[None] = loop.create_future()
        self._queued.append((fn, fut))
        if not self._kick_due:
            self._kick_due = True
            loop.call_soon(self._kick)  # the end of this step: writes made together go together
        return fut

    def flush(self) -> None:
        """Send what is queued to the store's thread now (before a statement that must run after it)."""
        if not self._queued:
            return
        batch, self._queued = self._queued, []
        db = self._db()
        assert db is not None, "the store is closed"
        self._in_flight += 1
        done = asyncio.wrap_future(self._pool.submit(commit, db, [fn for fn, _ in batch]))
        done.add_done_callback(lambda f: self._answer(f, batch))

    def _kick(self) -> None:
        self._kick_due = False
        if not self._in_flight:
            self.flush()

    def _answer(self, done: asyncio.Future[list[BaseException | None]],
                batch: list[tuple[Write, asyncio.Future[None]]]) -> None:
        self._in_flight -= 1
        try:
            outcomes: list[BaseException | None] = done.result()
        except BaseException as e:  # noqa: BLE001 — the batch could not even run: every caller gets why
            outcomes = [e] * len(batch)
        else:
            self.batches += 1
            self.writes += len(batch)
        for (_, fut), err in zip(batch, outcomes, strict=True):  # in the order they were asked
            if fut.cancelled():
                continue
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)
        if not self._in_flight:
            self.flush()


def commit(db: Db, writes: list[Write]) -> list[BaseException | None]:
    """On the store's thread: `writes` in one transaction; if it fails, each in its own. Each one's error or None."""
    try:
        _transaction(db, writes)
        return [None] * len(writes)
    except Exception:  # noqa: BLE001 — which one failed is found below
        if len(writes) == 1:
            raise
    log.debug("a batch of %d writes failed: running them one by one", len(writes))
    out: list[BaseException | None] = []
    for fn in writes:
        try:
            _transaction(db, [fn])
            out.append(None)
        except Exception as e:  # noqa: BLE001 — that caller's error
            out.append(e)
    return out


def _transaction(db: Db, writes: list[Write]) -> None:
    db.execute("BEGIN")
    try:
        for fn in writes:
            fn(db)
        db.execute("COMMIT")  # a failed COMMIT (SQLITE_BUSY) leaves the transaction open: rolled back below
    except BaseException:
        # Left open, the transaction would swallow every later write of the coordinator.
        try:
            db.execute("ROLLBACK")
        except Exception:  # noqa: BLE001 — a dead connection: the first error says more
            log.debug("rollback failed", exc_info=True)
        raise
