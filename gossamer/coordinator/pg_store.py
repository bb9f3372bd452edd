"""The coordinator's state in PostgreSQL (`--state postgresql://...`): the `Store` interface over psycopg 3, fenced by the leader's term."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from gossamer.coordinator.group_commit import GroupCommit
from gossamer.coordinator.store import Store
from gossamer.core.errors import ConfigError, NotLeaderError, UnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The advisory lock whose holder leads (any bigint; "gossamer" in ASCII).
LEADER_LOCK = 0x676F7373616D6572
_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS experiments (id TEXT PRIMARY KEY, seq BIGINT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS metrics (
  id BIGSERIAL PRIMARY KEY, experiment_id TEXT NOT NULL, time DOUBLE PRECISION NOT NULL,
  step BIGINT NOT NULL, source TEXT NOT NULL, data TEXT NOT NULL,
  n BIGINT NOT NULL DEFAULT 1, lo TEXT, hi TEXT);
CREATE INDEX IF NOT EXISTS metrics_by_exp ON metrics (experiment_id, time);
CREATE INDEX IF NOT EXISTS metrics_by_time ON metrics (time);
CREATE TABLE IF NOT EXISTS checkpoints (
  experiment_id TEXT NOT NULL, step BIGINT NOT NULL, path TEXT NOT NULL, kind TEXT NOT NULL,
  time DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS events (
  id BIGSERIAL PRIMARY KEY, time DOUBLE PRECISION NOT NULL, experiment_id TEXT NOT NULL,
  node_id TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS gossamer_leader (
  id INTEGER PRIMARY KEY, term BIGINT NOT NULL, address TEXT NOT NULL, since DOUBLE PRECISION NOT NULL);
INSERT INTO gossamer_leader VALUES (1, 0, '', 0) ON CONFLICT (id) DO NOTHING;
"""
_WRITES = ("INSERT", "UPDATE", "DELETE")
_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def is_postgres_url(state: str) -> bool:
    return state.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """`url` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def _translate(sql: str, named: bool) -> str:
    """sqlite3's placeholders (`?`, `:name`) as psycopg's (`%s`, `%(name)s`)."""
    return _NAMED.sub(r"%(\1)s", sql) if named else sql.replace("?", "%s")


class PgConn:
    """A psycopg connection speaking the sqlite3 subset the store uses (`execute`, `executemany`,
    explicit BEGIN/COMMIT/ROLLBACK in autocommit mode).

    Fencing: once `term` is set (this process leads), every write runs in a transaction that
    first reads the leader row FOR SHARE and aborts with NotLeaderError unless the term is still
    ours; a new leader's term bump waits for such a transaction, never interleaves with it.
    """

    dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.term = 0  # 0: not leading (no fencing: a store used on its own, or before the lead)
        self._in_tx = False

    def _check_term(self) -> None:
        row = self.conn.execute("SELECT term, address FROM gossamer_leader WHERE id = 1 FOR SHARE").fetchone()
        if row is None or int(row[0]) != self.term:
            raise NotLeaderError(row[1] if row else "")

    def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] = (), /) -> Any:
        word = sql.lstrip().split(None, 1)[0].upper()
        if word == "BEGIN":
            self.conn.execute("BEGIN")
            self._in_tx = True
            if self.term:
                try:
                    self._check_term()
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    self._in_tx = False
                    raise
            return None
        if word in ("COMMIT", "ROLLBACK"):
            self._in_tx = False
            return self.conn.execute(word)
        query = _translate(sql, isinstance(parameters, dict))
        if word in _WRITES and self.term and not self._in_tx:
            with self.conn.transaction():
                self._check_term()
                return self.conn.execute(query, parameters or None)
        return self.conn.execute(query, parameters or None)

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Any:
        rows = list(parameters)
        if not rows:
            return None
        query = _translate(sql, False)
        with self.conn.cursor() as cur:
            if self.term and not self._in_tx:
                with self.conn.transaction():
                    self._check_term()
                    cur.executemany(query, rows)
            else:
                cur.executemany(query, rows)
        return None

    def close(self) -> None:
        self.conn.close()


def connect(url: str) -> PgConn:
    """A connection that notices a dead peer within seconds (TCP keepalives and user timeout)."""
    try:
        import psycopg
    except ImportError:
        raise ConfigError("state", "a postgresql:// state needs psycopg 3: pip install 'gossamer[postgres]'") from None
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=10, keepalives=1, keepalives_idle=5,
                               keepalives_interval=2, keepalives_count=3, tcp_user_timeout=10000,
                               application_name="gossamer-coordinator")
    except psycopg.OperationalError as e:
        raise UnavailableError(f"cannot reach the state database at {redact(url)}: {str(e).strip()}") from None
    return PgConn(conn)


class PgStore(Store):
    """The coordinator's state in one PostgreSQL database; one connection on one thread.

    That connection also holds the leader's advisory lock (`try_lead`): PostgreSQL frees the lock
    only when the session ends, and a session that ended can write nothing more.
    """

    _UPSERT_NODE = "INSERT INTO nodes VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET data = EXCLUDED.data"
    _UPSERT_EXPERIMENT = ("INSERT INTO experiments VALUES (?, ?, ?) "
                          "ON CONFLICT (id) DO UPDATE SET seq = EXCLUDED.seq, data = EXCLUDED.data")

    def __init__(self, url: str) -> None:  # noqa: D107 — no super().__init__: there is no SQLite file
        if not is_postgres_url(url):
            raise ConfigError("state", f"expected postgresql://..., got {redact(url)!r}")
        self.url = url
        self.location = redact(url)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gossamer-pgstore")
        self._db = None
        self._pg: PgConn | None = None
        self.commits = GroupCommit(self._pool, lambda: self._db)
        self._steps_queued: dict[str, int] = {}
        #: Called (once) when a fenced write or the session fails while leading: stop acting.
        self.on_lost: Callable[[str], None] | None = None
        self._pool.submit(self._open).result()

    def _open(self) -> None:
        db = connect(self.url)
        # Two coordinators starting at once must not both create the tables.
        with db.conn.transaction():
            db.conn.execute("SELECT pg_advisory_xact_lock(%s)", (LEADER_LOCK - 1,))
            db.conn.execute(_SCHEMA)
        self._db = self._pg = db

    def reconnect(self) -> None:
        """A fresh session for a standby whose connection failed (never for a leader: its lock went with it)."""
        if self.term:
            raise NotLeaderError("")

        def _reopen() -> None:
            if self._pg is not None:
                try:
                    self._pg.close()
                except Exception:  # noqa: BLE001, S110 — it is already broken
                    pass
            self._db = self._pg = None
            self._open()

        self._pool.submit(_reopen).result()

    @property
    def term(self) -> int:
        """This process's leader term (0: it does not lead)."""
        return self._pg.term if self._pg is not None else 0

    async def run(self, fn: Callable[[Any], T]) -> T:
        return await self._fenced(super().run(fn))

    async def write(self, fn: Callable[[Any], object]) -> None:
        await self._fenced(super().write(fn))

    async def _fenced(self, call: Awaitable[T]) -> T:
        """`call`'s result; a lost term or session stops the leader (`on_lost`) and raises NotLeaderError."""
        import psycopg

        try:
            return await call
        except NotLeaderError as e:
            self._lost(str(e))
            raise
        except psycopg.OperationalError as e:  # the session (and with it the lock) is gone
            self._lost(f"state database: {str(e).strip()}")
            raise NotLeaderError("") from None

    def _lost(self, why: str) -> None:
        if self.term and self.on_lost is not None:
            on_lost, self.on_lost = self.on_lost, None
            on_lost(why)

    # --- leadership (on the store's thread, so the lock and the writes share one session) ----
    async def try_lead(self, address: str) -> int:
        """Take the leader lock if free: the new term (0: another coordinator leads)."""
        def _try(db: Any) -> int:
            if not db.conn.execute("SELECT pg_try_advisory_lock(%s)", (LEADER_LOCK,)).fetchone()[0]:
                return 0
            term = int(db.conn.execute(
                "UPDATE gossamer_leader SET term = term + 1, address = %s, since = %s WHERE id = 1 RETURNING term",
                (address, time.time())).fetchone()[0])
            db.term = term
            return term

        return await super().run(_try)

    async def leader(self) -> tuple[int, str]:
        """The current term and the leader's address (as the last leader wrote them)."""
        def _q(db: Any) -> tuple[int, str]:
            term, address = db.conn.execute("SELECT term, address FROM gossamer_leader WHERE id = 1").fetchone()
            return int(term), str(address)

        return await super().run(_q)

    async def still_leading(self) -> bool:
        """False once the term moved on or the session is gone (this process must stop acting)."""
        def _q(db: Any) -> bool:
            if db.term == 0:
                return False
            row = db.conn.execute("SELECT term FROM gossamer_leader WHERE id = 1").fetchone()
            return row is not None and int(row[0]) == db.term

        try:
            return await super().run(_q)
        except Exception as e:  # noqa: BLE001 — a lost connection is a lost lead
            log.error("state database check failed: %s", e)
            return False
