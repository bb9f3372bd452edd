"""The SQL connection both store backends speak (sqlite3's execute/executemany subset) and the dialect switch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class Db(Protocol):
    """What the store's statements use of a connection: sqlite3.Connection, or pg_store.PgConn."""

    def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] = ..., /) -> Any: ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Any: ...

    def close(self) -> None: ...


def is_postgres(db: Db) -> bool:
    """Whether `db` is a PostgreSQL connection (its statements differ where the dialects do)."""
    return getattr(db, "dialect", "") == "postgresql"
