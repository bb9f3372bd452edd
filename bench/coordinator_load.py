"""Coordinator under load: simulated nodes speaking the real gRPC protocol against a real `coordinator serve`.

    python -m bench.coordinator_load [--quick] [--nodes 100,500,...] [--beats grpc,udp] [--loaders 2] [--no-pin]

Each point starts a fresh `gossamer coordinator serve --rate-limit 0` (every simulated node shares
127.0.0.1, so the per-host token bucket, 200 requests/s by default, must be lifted: `--rate-limit 0`,
or env GOSSAMER_RATE_LIMIT=0), pinned to one core (`--no-pin`: not), then loader processes
(bench/_load_nodes.py) join N nodes, each with a WatchAssignments stream and a 1 Hz heartbeat: the
unary gRPC Heartbeat, or the UDP beat (docs/scale.md "UDP heartbeats"), one row each (`--beats`).
Measured over a window once every node has joined and warmed up: heartbeat round-trip latency
p50/p99 (seen by the client, so it includes the loaders' own event-loop delay on a loaded
machine), the coordinator's CPU (utime+stime from /proc) as a share of a core and per heartbeat
served, its resident set, and the nodes it declared lost (none may be: every node keeps beating).

Scenarios: the node-count curve; churn (1,000 short-lived joins and as many leaves a minute on
top of N nodes); 100 concurrent experiments (1 shard + backup + 2 workers each, the nodes
reporting roles and metrics); and a kill -9 of the coordinator mid-storm, restarted on the same
port and state: every node and experiment the killed one had acknowledged must be there.

Writes bench/results/coordinator_load.{json,md} and draws bench/out/coordinator_load.png (git-ignored; `--plot`
draws it again from the results alone).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench._load_nodes import LoaderConfig, loader_main
from bench._report import RESULTS, plot_path, write_report
from bench._wait import reap
from gossamer.core.experiment import Experiment
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Nodes arriving a second (all loaders together): machines of a fleet booting, a few hundred a second.
JOIN_RATE = 250.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def udp_drops() -> int:
    """Datagrams this machine's kernel dropped for a full socket receive buffer (all sockets), so far."""
    lines = [ln.split() for ln in Path("/proc/net/snmp").read_text().splitlines() if ln.startswith("Udp:")]
    return int(dict(zip(lines[0], lines[1], strict=True)).get("RcvbufErrors", 0))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Coordinator:
    """A `gossamer coordinator serve` subprocess on a fixed port and state directory (restartable)."""

    def __init__(self, state_dir: Path, *, lease_timeout_s: float, pin: bool, log: Path) -> None:
        self.state_dir, self.lease_timeout_s, self.pin, self.log = state_dir, lease_timeout_s, pin, log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        ready = self.state_dir / "ready"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "gossamer.tools.cli", "coordinator", "serve", "--port", str(self.port),
               "--state-dir", str(self.state_dir), "--rate-limit", "0", "--no-import-check",
               "--lease-timeout", str(self.lease_timeout_s), "--ready-file", str(ready), "--log-level", "WARNING"]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if self.pin and (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(self.proc.pid, {0})
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start; see {self.log}")
            time.sleep(0.05)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def snapshot(address: str) -> dict[str, Any]:
    """Nodes (id -> state) and experiments (id -> state, roles) as the coordinator at `address` lists them."""
    with grpc.insecure_channel(address) as ch:
        nodes = pb_grpc.NodeServiceStub(ch).ListNodes(pb.ListNodesRequest(), timeout=120)
        exps = pb_grpc.ExperimentServiceStub(ch).List(pb.ListExperimentsRequest(), timeout=120)
    return {
        "nodes": {n.id: n.state for n in nodes.nodes},
        "experiments": {e.id: (e.state, sorted((r.node_id, r.role, r.index) for r in e.roles))
                        for e in exps.experiments},
    }


def _lost_ever(address: str) -> dict[str, float]:
    """Nodes the coordinator at `address` declared lost at any time (its "lost" events), rejoined since or not,
    and when (unix seconds, the first time)."""
    with grpc.insecure_channel(address) as ch:
        events = pb_grpc.ExperimentServiceStub(ch).ListEvents(pb.ListEventsRequest(), timeout=120).events
    lost: dict[str, float] = {}
    for e in events:
        if e.kind == "lost" and e.node_id:
            lost.setdefault(e.node_id, e.time_unix)
    return lost


def _is_churn(node_id: str) -> bool:
    """A churn node's id (`_load_nodes.Loader._churn`: index 10,000,000 and up), not one of the fleet's."""
    return node_id.startswith("sim") and node_id[3:].isdigit() and int(node_id[3:]) >= 10_000_000


def submit_experiments(address: str, count: int) -> list[str]:
    """`count` async experiments of 1 shard (+ backup) and 2 workers; they start as nodes join."""
    ids = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ExperimentServiceStub(ch)
        for k in range(count):
            exp = Experiment(name=f"load-{k}", model="gossamer.examples.digits:mlp",
                             dataset="gossamer.examples.digits:data", mode="async", num_ps_shards=1,
                             min_workers=2, max_workers=2, total_steps=10**9)
            ids.append(stub.Submit(pb.SubmitRequest(experiment_json=exp.to_json()), timeout=60).experiment_id)
    return ids


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_point(n: int, *, loaders: int, warm_s: float, measure_s: float, pin: bool, workdir: Path,
              churn_per_min: float = 0.0, experiments: int = 0, kill9: bool = False,
              lease_timeout_s: float = 10.0, label: str = "", profile: str = "", beats: str = "grpc",
              join_rate: float = JOIN_RATE) -> dict[str, Any]:
    """One scenario at `n` nodes joining at `join_rate` a second, heartbeating over `beats` ("grpc" or "udp");
    returns its row."""
    state = Path(tempfile.mkdtemp(prefix=f"load-{n}-", dir=workdir))
    coord = Coordinator(state, lease_timeout_s=lease_timeout_s, pin=pin, log=state / "coordinator.log")
    coord.start()
    ctx = mp.get_context("spawn")
    measure, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = []
    counts: list[Any] = []  # nodes joined, per loader
    row: dict[str, Any] = {"scenario": label or "nodes", "beats": beats, "nodes": n}
    drops0 = udp_drops()
    try:
        exp_ids = submit_experiments(coord.address, experiments) if experiments else []
        per = -(-n // loaders)
        for k in range(loaders):
            count = min(per, n - k * per)
            cfg = LoaderConfig(address=coord.address, first=k * per, count=count, joins_per_s=join_rate / loaders,
                               churn_per_min=churn_per_min / loaders, udp=beats == "udp")
            counts.append(ctx.Value("i", 0, lock=False))
            p = ctx.Process(target=loader_main, args=(cfg, measure, stop, out, counts[-1]), daemon=True)
            p.start()
            procs.append(p)
        t_join, wall_join = time.monotonic(), time.time()
        pid = coord.proc.pid if coord.proc else 0
        c_join = cpu_s(pid)
        storm = n / join_rate
        spy = _profile(pid, storm + 2, profile, f"join-{label or 'nodes'}-{beats}-{n}") if profile else None
        row["joined"] = _wait_joined(counts, n, timeout_s=max(120.0, 3 * storm))
        row["join_s"] = round(time.monotonic() - t_join, 1)
        row["join_rate"] = join_rate
        row["join_cpu_ms"] = round((cpu_s(pid) - c_join) * 1e3 / max(1, row["joined"]), 2)  # coordinator CPU per join
        row["join_loadavg"] = round(os.getloadavg()[0], 1)
        if spy is not None:
            spy.wait(60)
        if experiments:
            _wait_running(coord.address, exp_ids, timeout_s=120.0)
        time.sleep(warm_s)
        pid = coord.proc.pid if coord.proc else 0
        loader_cpu0 = sum(cpu_s(p.pid or 0) for p in procs)
        c0, t0 = cpu_s(pid), time.monotonic()
        t_measure = t0
        measure.set()
        spy = _profile(pid, measure_s, profile, f"{label or 'nodes'}-{beats}-{n}") if profile else None
        if kill9:
            row.update(_kill9_mid_storm(coord, measure_s))
            pid = coord.proc.pid if coord.proc else 0
            c0, t0 = cpu_s(pid), time.monotonic()
            time.sleep(measure_s / 2)
        else:
            time.sleep(measure_s)
        c1, t1 = cpu_s(pid), time.monotonic()
        row["loadavg"] = round(os.getloadavg()[0], 1)  # the machine is shared: its load over the window's last minute
        loader_cpu1 = sum(cpu_s(p.pid or 0) for p in procs)
        row["rss_mb"] = round(rss_mb(pid), 1)
        final = snapshot(coord.address)
        lost_ever = _lost_ever(coord.address)
        if spy is not None:
            spy.wait(60)
        stop.set()
        stats = [out.get(timeout=120) for _ in procs]
    finally:
        stop.set()
        reap(procs)
        coord.stop()
    lat = [x for s in stats for x in s["latencies_ms"]]
    unsaid = {k for s in stats for k in s["leave_undelivered"]}
    window = t1 - t0
    served_per_s = len(lat) / (t1 - t_measure)
    cores = (c1 - c0) / window
    last_join = max((s["join_done_at"] for s in stats), default=0.0)
    row.update({
        "join_s": round(last_join - wall_join, 1) if last_join else row["join_s"],  # first sent to last answered
        "join_attempts": sum(s["join_attempts"] for s in stats),
        "join_p50_ms": round(percentile(joins_ms := [x for s in stats for x in s["join_ms"]], 0.50), 1),
        "join_p99_ms": round(percentile(joins_ms, 0.99), 1),
        "hb_per_s": round(served_per_s, 0),
        "asked_per_s": n,
        "p50_ms": round(percentile(lat, 0.50), 2),
        "p99_ms": round(percentile(lat, 0.99), 2),
        "max_ms": round(max(lat, default=float("nan")), 1),
        "coord_cores": round(cores, 3),
        "cpu_us_per_hb": round(cores / served_per_s * 1e6, 1) if served_per_s else float("nan"),
        "loader_cores": round((loader_cpu1 - loader_cpu0) / window, 2),
        # A churn node whose Leave never got through stopped beating unannounced: its loss is right.
        "lost": sum(1 for k, s in final["nodes"].items() if s == pb.NODE_STATE_LOST and k not in unsaid),
        "lost_ever": len(lost_ever.keys() - unsaid),
        "left_unsaid": len(unsaid),
        "lost_ever_churn": sum(1 for k in lost_ever.keys() - unsaid if _is_churn(k)),  # of lost_ever: short-lived nodes
        "unknown_hb": sum(s["unknown"] for s in stats),
        **{k: sum(s[k] for s in stats) for k in ("udp_beats", "udp_misses", "udp_pauses", "grpc_beats")},
        "grpc_max_in_flight": max(s["grpc_max_in_flight"] for s in stats),
        "udp_rcvbuf_drops": udp_drops() - drops0,
        "errors": _merge_errors(stats),
    })
    if (killed_at := row.pop("killed_at", None)) is not None:
        # On the bench's output only: when each (false) loss came, against the kill, and whose node it was.
        when = sorted((t - killed_at, "churn" if _is_churn(k) else "fleet") for k, t in lost_ever.items() if k not in unsaid)
        print("lost after the kill (s, node):", " ".join(f"{t:.1f}:{w}" for t, w in when) or "none", flush=True)
    if churn_per_min:
        row["churn_joined"] = sum(s["churn_joined"] for s in stats)
        row["churn_left"] = sum(s["churn_left"] for s in stats)
    if experiments:
        running = sum(1 for e in exp_ids if final["experiments"].get(e, (0,))[0] == pb.EXPERIMENT_STATE_RUNNING)
        row["experiments_running"] = running
        row["metric_reports"] = sum(s["metric_reports"] for s in stats)
    return row


def _profile(pid: int, seconds: float, out_dir: str, name: str) -> subprocess.Popen[bytes]:
    """py-spy (next to this Python) samples the coordinator for `seconds`: a flame graph in `out_dir`."""
    spy = Path(sys.executable).parent / "py-spy"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(spy), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "50", "-f", "raw",
                             "-o", str(Path(out_dir) / f"{name.replace(' ', '_')}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _merge_errors(stats: list[dict[str, Any]]) -> str:
    merged: dict[str, int] = {}
    for s in stats:
        for k, v in s["errors"].items():
            merged[k] = merged.get(k, 0) + v
    return ",".join(f"{k}:{v}" for k, v in sorted(merged.items())) or "-"


def _wait_joined(counts: list[Any], n: int, timeout_s: float) -> int:
    """Nodes joined (the loaders' counts) once all `n` have, or when `timeout_s` is up: past the ceiling, not all do."""
    deadline = time.monotonic() + timeout_s
    while True:
        joined = sum(c.value for c in counts)
        if joined >= n or time.monotonic() > deadline:
            return joined
        time.sleep(0.2)


def _wait_running(address: str, exp_ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = snapshot(address)["experiments"]
        if all(states[e][0] == pb.EXPERIMENT_STATE_RUNNING for e in exp_ids):
            return
        time.sleep(1.0)
    raise TimeoutError("experiments did not all reach RUNNING")


def _kill9_mid_storm(coord: Coordinator, measure_s: float) -> dict[str, Any]:
    """kill -9 the coordinator halfway through, restart it on its port and state; compare what it lists."""
    time.sleep(measure_s / 2)
    before = snapshot(coord.address)
    killed_at = time.time()
    coord.kill9()
    t0 = time.monotonic()
    coord.start()
    restart_s = time.monotonic() - t0
    after = snapshot(coord.address)
    missing_nodes = [k for k in before["nodes"] if k not in after["nodes"]]
    changed_exps = [k for k, v in before["experiments"].items() if after["experiments"].get(k) != v]
    return {"restart_s": round(restart_s, 2), "killed_at": killed_at, "nodes_before": len(before["nodes"]),
            "nodes_missing_after": len(missing_nodes), "experiments_changed_after": len(changed_exps)}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax2 = axes[1].twinx()
    for beats in sorted({r.get("beats", "grpc") for r in rows}):
        curve = [r for r in rows if r["scenario"] == "nodes" and r.get("beats", "grpc") == beats]
        xs = [r["nodes"] for r in curve]
        axes[0].plot(xs, [r["p50_ms"] for r in curve], "o-", label=f"p50 {beats}")
        axes[0].plot(xs, [r["p99_ms"] for r in curve], "s-", label=f"p99 {beats}")
        axes[1].plot(xs, [r["coord_cores"] for r in curve], "o-", label=f"coordinator cores, {beats}")
        axes[1].plot(xs, [r["hb_per_s"] / max(1, r["asked_per_s"]) for r in curve], "s-", label=f"served / asked, {beats}")
        ax2.plot(xs, [r["cpu_us_per_hb"] for r in curve], "^:", label=f"CPU us / heartbeat, {beats}")
        axes[2].plot(xs, [r["rss_mb"] for r in curve], "o-", label=beats)
    axes[0].axhline(50, color="grey", ls="--", label="target p99 50 ms")
    axes[0].set(xscale="log", yscale="log", xlabel="nodes (1 Hz heartbeats)", ylabel="heartbeat latency, ms")
    axes[1].set(xscale="log", xlabel="nodes", ylabel="share")
    ax2.set(yscale="log", ylabel="coordinator CPU us per heartbeat")
    ax2.legend(fontsize=8, loc="lower right")
    axes[2].set(xscale="log", xlabel="nodes", ylabel="coordinator RSS, MB")
    axes[2].legend(fontsize=8)
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100, 500, 1000 nodes, short windows")
    ap.add_argument("--nodes", default="", help="comma-separated node counts (default 100..10000)")
    ap.add_argument("--loaders", type=int, default=2, help="loader processes")
    ap.add_argument("--beats", default="grpc,udp",
                    help="heartbeat transports of the node-count curve, a row each (the scenarios use the last)")
    ap.add_argument("--measure", type=float, default=0.0, help="seconds measured per point")
    ap.add_argument("--join-rate", type=float, default=JOIN_RATE, help="nodes arriving a second (all loaders)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin the coordinator to core 0")
    ap.add_argument("--skip", default="", help="comma-separated scenarios to skip: churn,experiments,kill9")
    ap.add_argument("--out", default=str(RESULTS), help="results directory")
    ap.add_argument("--profile", default="", help="py-spy the coordinator over each window: folded stacks here")
    ap.add_argument("--keep", default="",
                    help="earlier coordinator_load.json files (comma-separated) whose rows are kept after the new ones, "
                         "tagged with their time")
    ap.add_argument("--plot", action="store_true", help="run nothing: draw bench/out/coordinator_load.png from the "
                                                        "coordinator_load.json in --out")
    args = ap.parse_args(argv)
    if args.plot:
        plot(json.loads((Path(args.out) / "coordinator_load.json").read_text())["rows"], plot_path("coordinator_load"))
        return 0
    counts = [int(x) for x in args.nodes.split(",") if x] or (
        [100, 500, 1000] if args.quick else [100, 500, 1000, 2000, 5000, 10000])
    measure_s = args.measure or (10.0 if args.quick else 30.0)
    warm_s = 3.0 if args.quick else 10.0
    skip = set(args.skip.split(","))
    base = 200 if args.quick else 1000
    rows: list[dict[str, Any]] = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coordinator-load-") as tmp:
        work = Path(tmp)
        kw = {"loaders": args.loaders, "warm_s": warm_s, "measure_s": measure_s, "pin": args.pin, "workdir": work,
              "profile": args.profile, "join_rate": args.join_rate}
        transports = [b for b in args.beats.split(",") if b]
        for n in counts:
            for beats in transports:
                rows.append(run_point(n, beats=beats, **kw))  # type: ignore[arg-type]
                print(json.dumps(rows[-1]), flush=True)
                (Path(args.out) / "coordinator_load.partial.json").write_text(json.dumps(rows, indent=1))
        kw["beats"] = transports[-1]
        if "churn" not in skip:
            rows.append(run_point(base, churn_per_min=1000.0, label="churn 1000/min", **kw))  # type: ignore[arg-type]
            print(json.dumps(rows[-1]), flush=True)
        if "experiments" not in skip:
            n_exp = 20 if args.quick else 100
            rows.append(run_point(max(base, 4 * n_exp), experiments=n_exp, label=f"{n_exp} experiments",
                                  **kw))  # type: ignore[arg-type]
            print(json.dumps(rows[-1]), flush=True)
        if "kill9" not in skip:
            n_exp = 10 if args.quick else 50
            rows.append(run_point(max(base, 4 * n_exp), experiments=n_exp, churn_per_min=1000.0, kill9=True,
                                  label="kill -9 mid-storm", **kw))  # type: ignore[arg-type]
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    notes = (f"Simulated nodes (bench/_load_nodes.py, {args.loaders} loader processes) against one `gossamer coordinator "
             f"serve --rate-limit 0`{' pinned to one core' if args.pin else ''}; 1 Hz heartbeats, lease 10 s; "
             f"{measure_s:g} s measured per point after {warm_s:g} s warm-up. beats: grpc, the unary Heartbeat; "
             "udp, one authenticated datagram and its reply (docs/scale.md, \"UDP heartbeats\"), with gRPC as the real node's "
             "fallback (udp_misses: ticks whose previous beat had no reply; udp_pauses: nodes that turned to gRPC alone; "
             "grpc_beats: gRPC Heartbeats sent in the window; udp_timeouts, older rows: beats unanswered within 3 s). "
             "Joins paced at join_rate a second (NodeAgent's 5 s deadline and back-off): join_s from the first sent to "
             "the last answered, join_cpu_ms the coordinator's CPU over the storm per node joined (everything it did "
             "meanwhile included). lost_ever: nodes with a 'lost' event (declared lost at any time, rejoined since or "
             "not); udp_rcvbuf_drops: datagrams the kernel dropped for full receive buffers during the point (all "
             "sockets). run: this run, or the time of an earlier "
             "one kept (--keep; rows without beats there were gRPC). loadavg: the machine's 1-minute load average at the "
             "end of the window. Latency: client round trip (includes "
             "the loaders' own event-loop delay: the loaders share this machine's cores with the coordinator and "
             "other jobs). coord_cores: coordinator utime+stime / wall; cpu_us_per_hb: that over heartbeats served "
             "(all its work, joins, streams, roles and metrics included). lost: nodes the coordinator declared lost "
             "(every simulated node keeps beating or leaves saying so: any is false), and lost_ever: nodes with a 'lost' "
             "event, both without the churn nodes of left_unsaid: those whose Leave went unanswered through the "
             "agent's retries (NodeAgent.shutdown: transient failures retried for 25 s). kill -9: nodes/experiments listed before the "
             "kill that the restarted coordinator lacks or lists differently.")
    for r in rows:
        r["run"] = "this"
    for kept in filter(None, args.keep.split(",")):
        earlier = json.loads(Path(kept).read_text())
        rows += [{**r, "beats": r.get("beats", "grpc"),
                  "run": earlier["time"] if r.get("run", "this") == "this" else r["run"]} for r in earlier["rows"]]
    write_report("coordinator_load", rows, notes, out)
    plot(rows, plot_path("coordinator_load"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
