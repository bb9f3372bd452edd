"""Metric series are unbounded: every stored point is kept and read on each `/api/series` and GetMetrics.

Issue 15 ("Smaller"): "`/api/series` and GetMetrics read every stored point on each request and
nothing is ever trimmed (a day-long run: seconds per request, and past the client's 4 MiB
message limit `gossamer plot` fails)". Here: a coordinator (HTTP on) with one queued experiment
is stopped, a day of worker reports (86,400 points, one a second, 2 sources) is written into its
SQLite `metrics` table as the coordinator itself writes them, and it is started again, with
`--metrics-retention 300` where the flag exists. After up to 90 s for a retention pass: rows
stored, `/api/series` (bytes, seconds, points), `Job.metrics()` (GetMetrics; points or error).
PASS: under a tenth of the points stay stored, `/api/series` answers under 1 MB and GetMetrics
answers with at most 10,000 points (912ec8e already thins `/api/series` to 300 points per series,
after reading every row; the 4 MiB limit is GetMetrics').
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import LOG_ROOT, Outcome, digits_experiment, main, mb, wait_for

NAME = "metric_series"
POINTS = 86_400
SOURCES = ("worker:0", "shard:0")


def _rows(db: Path, exp_id: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
        return int(con.execute("SELECT COUNT(*) FROM metrics WHERE experiment_id = ?", (exp_id,)).fetchone()[0])


def _start(tmp: str, label: str, args: list[str]) -> object:
    from gossamer.local_cluster import LocalCluster

    lc = LocalCluster(tmp, log_dir=LOG_ROOT / label / NAME, coordinator_args=["--http-port", "0", *args])
    lc.start_coordinator(port=0)
    return lc


def run(label: str) -> Outcome:
    help_text = subprocess.run([sys.executable, "-m", "gossamer.cli", "coordinator", "serve", "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    flag = "--metrics-retention" in help_text
    args = ["--metrics-retention", "300"] if flag else []
    with tempfile.TemporaryDirectory(prefix="repro15-") as tmp:
        db = Path(tmp) / "coordinator.sqlite"
        lc = _start(tmp, label, args)
        try:
            client = lc.client()  # type: ignore[attr-defined]
            job = client.submit(digits_experiment(NAME))
            client.close()
        finally:
            lc.close()  # type: ignore[attr-defined]
        t_end = time.time()
        rows = [(job.id, t_end - POINTS + i, i, src, json.dumps({"loss": 1.0 / (i + 1), "samples_per_s": 100.0 + i % 7}))
                for i in range(POINTS // len(SOURCES)) for src in SOURCES]
        with sqlite3.connect(db) as con:
            con.executemany("INSERT INTO metrics (experiment_id, time, step, source, data) VALUES (?,?,?,?,?)", rows)
        stored_before = _rows(db, job.id)
        lc = _start(tmp, label, args)
        try:
            if flag:
                seen = [stored_before]

                def merged() -> bool:  # a pass merges in batches: wait until the count stops falling
                    seen.append(_rows(db, job.id))
                    return seen[-1] == seen[-2] < stored_before

                try:
                    wait_for(merged, 90, "a retention pass to finish", every=3.0)
                except TimeoutError:
                    pass
            stored = _rows(db, job.id)
            port = int((Path(tmp) / "http.port").read_text())
            t0 = time.monotonic()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/series?experiment={job.id}", timeout=300) as r:
                body = r.read()
            series_s = time.monotonic() - t0
            series_points = _count_points(json.loads(body))
            client = lc.client()  # type: ignore[attr-defined]
            t0 = time.monotonic()
            try:
                got = f"{len(client.job(job.id).metrics())} points"
                n_metrics = int(got.split()[0])
            except Exception as e:  # noqa: BLE001 - the 4 MiB limit is the failure the issue names
                got, n_metrics = f"{type(e).__name__}: {str(e)[:120]}", -1
            metrics_s = time.monotonic() - t0
            client.close()
        finally:
            lc.close()  # type: ignore[attr-defined]
    passed = stored * 10 < stored_before and len(body) < 1_000_000 and 0 <= n_metrics <= 10_000
    figure = (f"{stored_before} points written, {stored} stored after restart; /api/series {mb(len(body))} "
              f"({series_points} points) in {series_s:.1f} s; GetMetrics: {got} in {metrics_s:.1f} s")
    return Outcome(NAME, passed, figure, {"retention_flag": flag, "stored_before": stored_before, "stored": stored,
                                          "series_bytes": len(body), "series_points": series_points,
                                          "series_s": round(series_s, 2), "get_metrics": got,
                                          "get_metrics_s": round(metrics_s, 2)})


def _count_points(body: object) -> int:
    """The longest list in the /api/series answer (a series of [t, value] points)."""
    best = 0
    stack = [body]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            best = max(best, len(v))
            stack.extend(x for x in v if isinstance(x, (list, dict)))
        elif isinstance(v, dict):
            stack.extend(v.values())
    return best


if __name__ == "__main__":
    main(NAME, run)
