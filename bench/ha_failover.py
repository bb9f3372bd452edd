"""Failover of the highly available coordinator (docs/ha.md) against the single coordinator's restart, measured in the same run.

    python -m bench.ha_failover [--trials N]

Each trial: a fresh database on a throwaway PostgreSQL server (initdb in a temp dir), two
`coordinator serve --state postgresql://...` processes, three nodes given both addresses; kill -9
of the leader, then measured from the kill:

- lead_s: until the standby's health service says SERVING (it leads);
- client_s: until a `Client` given both addresses answers `nodes()` with all three;
- baseline_s: the single SQLite coordinator killed -9 and started again at once on the same
  state dir and port (what a supervisor restarting it achieves), until a `Client` answers the same.

Writes bench/results/ha_failover.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

from bench._postgres import PostgresServer, find_bin_dir, leads
from bench._report import write_report
from bench._wait import wait
from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster

NODES = ("n0", "n1", "n2")


def _since(t0: float, pred, what: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds from `t0` until `pred` holds (polled every 10 ms, 60 s at most)."""
    wait(pred, 60, what, period=0.01)
    return time.monotonic() - t0


def _all_nodes(client: Client) -> bool:
    try:
        return sum(n["state"] == "ready" for n in client.nodes()) == len(NODES)
    except Exception:  # noqa: BLE001 — between leaders
        return False


def _cluster(tmp: str) -> LocalCluster:
    return LocalCluster(Path(tmp) / "cluster", heartbeat_interval=0.5, lease_timeout=5.0, stop_grace_s=0.0)


def ha_trial(pg: PostgresServer) -> dict[str, float]:
    url = pg.new_database()
    with tempfile.TemporaryDirectory(prefix="gossamer-ha-") as tmp, _cluster(tmp) as cluster:
        cluster.start_replicas(url, count=2)
        with psycopg.connect(url) as conn:
            leader = conn.execute("SELECT address FROM gossamer_leader").fetchone()[0]
        names = {f"127.0.0.1:{p}": n for n, p in cluster.replica_ports.items()}
        (standby,) = set(names) - {leader}
        for n in NODES:
            cluster.add_node(n)
        with Client(cluster.address, timeout=5.0) as client:
            wait(lambda: _all_nodes(client), 60, "three nodes")
            t0 = time.monotonic()
            cluster.kill_coordinator(names[leader])
            lead_s = _since(t0, lambda: leads(standby), "the standby to lead")
            client_s = _since(t0, lambda: _all_nodes(client), "the client to list the nodes")
    return {"lead_s": lead_s, "client_s": client_s}


def baseline_trial() -> float:
    with tempfile.TemporaryDirectory(prefix="gossamer-ha-") as tmp, _cluster(tmp) as cluster:
        cluster.start_coordinator(port=0)
        for n in NODES:
            cluster.add_node(n)
        with Client(cluster.address, timeout=1.0) as client:
            wait(lambda: _all_nodes(client), 60, "three nodes")
            t0 = time.monotonic()
            cluster.kill_coordinator()
            cluster.start_coordinator()
            return _since(t0, lambda: _all_nodes(client), "the restarted coordinator to list the nodes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    bin_dir, why = find_bin_dir()
    if bin_dir is None:
        raise SystemExit(why)
    pg = PostgresServer(bin_dir).start()
    rows = []
    try:
        for i in range(args.trials):
            ha = ha_trial(pg)
            base = baseline_trial()
            row = {"trial": i, **ha, "baseline_s": base, "client_vs_baseline": ha["client_s"] / base}
            print(row, flush=True)
            rows.append(row)
    finally:
        pg.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in ("lead_s", "client_s", "baseline_s")}
    rows.append({"trial": "median", **med, "client_vs_baseline": med["client_s"] / med["baseline_s"]})
    notes = ("kill -9 of the leading coordinator (2 on one PostgreSQL 15 database, 3 idle nodes given both "
             "addresses): lead_s until the standby reports SERVING, client_s until a Client given both addresses "
             "lists the 3 nodes; baseline_s: one SQLite coordinator killed -9 and restarted at once on its state "
             "(a supervisor's best case), until a Client lists them. Seconds; this machine's 2 cores are shared.")
    js, md = write_report("ha_failover", rows, notes)
    print(md.read_text())


if __name__ == "__main__":
    main()
