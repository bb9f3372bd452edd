"""Metric points in SQL: bounded, paged reads (merged per source into time buckets) and downsampling of old points.

A stored row is a point as reported (`lo` NULL) or a downsampled one: its `data` holds the
means of the `n` points it stands for, `lo`/`hi` their minimum and maximum per key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from gossamer.coordinator.sql import Db, is_postgres
from gossamer.core.errors import ConfigError

#: Points a GetMetrics answer holds when the request names no max_points.
DEFAULT_MAX_POINTS = 5000
#: Points per page: with a few dozen keys each, a page stays well under 4 MiB.
PAGE_POINTS = 500
#: Serialized bytes after which a page is cut (at a bucket's end).
PAGE_BYTES = 1 << 20
#: Time span downsampled per statement, so one pass never holds the store thread long.
_DOWNSAMPLE_CHUNK_S = 3600.0

MIGRATIONS = (
    "ALTER TABLE metrics ADD COLUMN n INTEGER NOT NULL DEFAULT 1",
    "ALTER TABLE metrics ADD COLUMN lo TEXT",
    "ALTER TABLE metrics ADD COLUMN hi TEXT",
)


def migrate(db: Db) -> None:
    """Add the downsampling columns to a metrics table made before they existed."""
    have = {row[1] for row in db.execute("PRAGMA table_info(metrics)")}
    for sql in MIGRATIONS:
        if sql.split(" ADD COLUMN ")[1].split()[0] not in have:
            db.execute(sql)


@dataclass
class Point:
    """One answered point: as reported (count 1) or merged from `count` points of one source."""

    time: float
    step: int
    source: str
    values: dict[str, float]
    count: int = 1
    lo: dict[str, float] = field(default_factory=dict)
    hi: dict[str, float] = field(default_factory=dict)


@dataclass
class Page:
    """A page of points: the token that continues it (empty: done) and the bucket width (0: raw)."""

    points: list[Point]
    next_token: str
    bucket_s: float


def _numbers(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    data = json.loads(text)
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _plan(db: Db, exp_id: str, since: float, max_points: int, per_source: bool) -> dict[str, Any]:
    """The first page's cursor: raw rows when the range holds few enough, else a bucket grid."""
    n, t_min, t_max, sources = db.execute(
        "SELECT COUNT(*), MIN(time), MAX(time), COUNT(DISTINCT source) FROM metrics "
        "WHERE experiment_id=? AND time>?", (exp_id, since)).fetchone()
    if not n:
        return {"m": "done"}
    if per_source:
        max_points *= sources
    if n <= max_points:
        return {"m": "raw", "t": since, "id": 1 << 62, "u": t_max}  # id: no row at `since` itself
    # Each source gets span/width buckets: sources * buckets <= max_points.
    width = max((t_max - t_min) * sources / max_points, 1e-3) * 1.0001
    return {"m": "agg", "t0": t_min, "w": width, "b": 0, "u": t_max, "s": sources}


def _decode(token: str) -> dict[str, Any]:
    try:
        cur = json.loads(token)
        if cur.get("m") == "raw":
            return {"m": "raw", "t": float(cur["t"]), "id": int(cur["id"]), "u": float(cur["u"])}
        if cur.get("m") == "agg" and float(cur["w"]) > 0:
            return {"m": "agg", "t0": float(cur["t0"]), "w": float(cur["w"]), "b": int(cur["b"]),
                    "u": float(cur["u"]), "s": max(1, int(cur["s"]))}
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    raise ConfigError("page_token", "not a token this coordinator issued")


def read_page(db: Db, exp_id: str, since: float, max_points: int, token: str = "",
              per_source: bool = False) -> Page:
    """One page of `exp_id`'s points after `since`, at most `max_points` over all pages (per
    source with `per_source`)."""
    if max_points < 0:
        raise ConfigError("max_points", f"must be >= 0, got {max_points}")
    cur = _decode(token) if token else _plan(db, exp_id, since, max_points or DEFAULT_MAX_POINTS, per_source)
    if cur["m"] == "raw":
        return _raw_page(db, exp_id, cur)
    if cur["m"] == "agg":
        return _agg_page(db, exp_id, cur)
    return Page([], "", 0.0)


def _raw_page(db: Db, exp_id: str, cur: dict[str, Any]) -> Page:
    rows = db.execute(
        "SELECT id, time, step, source, data, n, lo, hi FROM metrics WHERE experiment_id=? "
        "AND (time>? OR (time=? AND id>?)) AND time<=? ORDER BY time, id LIMIT ?",
        (exp_id, cur["t"], cur["t"], cur["id"], cur["u"], PAGE_POINTS)).fetchall()
    points, size = [], 0
    for row_id, t, step, source, data, n, lo, hi in rows:
        points.append(Point(t, step, source, _numbers(data), n, _numbers(lo), _numbers(hi)))
        size += len(data) * (3 if lo else 1) + len(source) + 32
        cur = {**cur, "t": t, "id": row_id}
        if size >= PAGE_BYTES:
            break
    done = len(points) < PAGE_POINTS and size < PAGE_BYTES
    return Page(points, "" if done else json.dumps(cur), 0.0)


_AGG_SQL = """
SELECT CAST((m.time - :t0) / :w AS INTEGER) AS b, m.source, j.key,
       SUM(j.value * m.n) / SUM(m.n),
       MIN(COALESCE(json_extract(m.lo, '$."' || j.key || '"'), j.value)),
       MAX(COALESCE(json_extract(m.hi, '$."' || j.key || '"'), j.value)),
       SUM(m.n), MAX(m.time), MAX(m.step)
FROM metrics m, json_each(m.data) j
WHERE m.experiment_id = :e AND m.time >= :lo AND m.time < :hi AND m.time >= :t0 AND m.time <= :u
  AND j.type IN ('integer', 'real')
GROUP BY b, m.source, j.key
ORDER BY b, m.source
"""
# PostgreSQL: FLOOR where SQLite's CAST truncates (the same for the non-negative offsets here).
_AGG_SQL_PG = """
SELECT FLOOR((m.time - :t0) / :w)::bigint AS b, m.source, j.key,
       SUM(j.value::float8 * m.n) / SUM(m.n),
       MIN(COALESCE((m.lo::jsonb ->> j.key)::float8, j.value::float8)),
       MAX(COALESCE((m.hi::jsonb ->> j.key)::float8, j.value::float8)),
       SUM(m.n), MAX(m.time), MAX(m.step)
FROM metrics m, jsonb_each(m.data::jsonb) j
WHERE m.experiment_id = :e AND m.time >= :lo AND m.time < :hi AND m.time >= :t0 AND m.time <= :u
  AND jsonb_typeof(j.value) = 'number'
GROUP BY b, m.source, j.key
ORDER BY b, m.source
"""
_DOWNSAMPLE_SQL = """SELECT m.experiment_id, m.source, CAST(m.time / :w AS INTEGER) AS b, j.key,
                  AVG(j.value), MIN(j.value), MAX(j.value), COUNT(*), MAX(m.time), MAX(m.step)
           FROM metrics m, json_each(m.data) j
           WHERE m.lo IS NULL AND m.time < :end AND j.type IN ('integer', 'real')
           GROUP BY m.experiment_id, m.source, b, j.key"""
_DOWNSAMPLE_SQL_PG = """SELECT m.experiment_id, m.source, FLOOR(m.time / :w)::bigint AS b, j.key,
                  AVG(j.value::float8), MIN(j.value::float8), MAX(j.value::float8), COUNT(*), MAX(m.time),
                  MAX(m.step)
           FROM metrics m, jsonb_each(m.data::jsonb) j
           WHERE m.lo IS NULL AND m.time < :end AND jsonb_typeof(j.value) = 'number'
           GROUP BY m.experiment_id, m.source, b, j.key"""


def _agg_page(db: Db, exp_id: str, cur: dict[str, Any]) -> Page:
    """Buckets [b, b + k) of the grid, k chosen so that a page holds about PAGE_POINTS points."""
    t0, w, b, until = cur["t0"], cur["w"], cur["b"], cur["u"]
    last_b = int((until - t0) / w)
    k = max(1, PAGE_POINTS // cur["s"])
    # The row's own bucket expression decides; the range only narrows the index scan.
    lo, hi = t0 + b * w - w, t0 + (b + k) * w + w
    merged: dict[tuple[int, str], Point] = {}
    for bucket, source, key, mean, vmin, vmax, n, t, step in db.execute(
            _AGG_SQL_PG if is_postgres(db) else _AGG_SQL, {"t0": t0, "w": w, "e": exp_id, "lo": lo, "hi": hi, "u": until}):
        if not b <= bucket < b + k:
            continue
        p = merged.get((bucket, source))
        if p is None:
            p = merged[(bucket, source)] = Point(t, step, source, {}, 0)
        p.time, p.step, p.count = max(p.time, t), max(p.step, step), max(p.count, int(n))
        p.values[key], p.lo[key], p.hi[key] = float(mean), float(vmin), float(vmax)
    points = [merged[key] for key in sorted(merged, key=lambda kb: (merged[kb].time, kb[1]))]
    nxt = b + k
    return Page(points, "" if nxt > last_b else json.dumps({**cur, "b": nxt}), w)


def downsample(db: Db, before: float, bucket_s: float) -> int:
    """Merge the points reported before `before` into one per source per `bucket_s` bucket.

    Works through at most _DOWNSAMPLE_CHUNK_S of time per call, oldest first; returns the
    number of reported rows it merged (0: none older is left).
    """
    # Bucket edges are multiples of bucket_s, so a bucket is merged once and whole.
    before = math.floor(before / bucket_s) * bucket_s
    oldest = db.execute("SELECT MIN(time) FROM metrics WHERE lo IS NULL AND time<?", (before,)).fetchone()[0]
    if oldest is None:
        return 0
    end = min(before, (math.floor((oldest + _DOWNSAMPLE_CHUNK_S) / bucket_s) + 1) * bucket_s)
    rows = db.execute(_DOWNSAMPLE_SQL_PG if is_postgres(db) else _DOWNSAMPLE_SQL,
                      {"w": bucket_s, "end": end}).fetchall()
    merged: dict[tuple[str, str, int], dict[str, Any]] = {}
    for exp_id, source, b, key, mean, vmin, vmax, n, t, step in rows:
        m = merged.setdefault((exp_id, source, b), {"n": 0, "t": t, "step": step, "data": {}, "lo": {}, "hi": {}})
        m["n"], m["t"], m["step"] = max(m["n"], int(n)), max(m["t"], t), max(m["step"], step)
        m["data"][key], m["lo"][key], m["hi"][key] = float(mean), float(vmin), float(vmax)
    db.execute("BEGIN")
    try:
        gone = db.execute("DELETE FROM metrics WHERE lo IS NULL AND time < ?", (end,)).rowcount
        db.executemany(
            "INSERT INTO metrics (experiment_id, time, step, source, data, n, lo, hi) VALUES (?,?,?,?,?,?,?,?)",
            [(e, m["t"], m["step"], s, json.dumps(m["data"]), m["n"], json.dumps(m["lo"]), json.dumps(m["hi"]))
             for (e, s, _), m in merged.items()])
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return int(gone)
