"""A 104M-parameter model (415 MB fp32) through real processes: peak memory per role, the step's parts,
push+pull against raw ZMQ, and serving while a checkpoint is taken.

    python -m bench.scale_model [--label LABEL] [--modes async,sync,diloco] [--steps N]
                                [--set FIELD=VALUE ...]
    python -m bench.scale_model --render [--label LABEL]   # the markdown again, from the JSON

`--set` overrides an experiment field in every mode's spec (VALUE read as JSON, else as a string),
e.g. `--modes diloco --set round_start=shards --set error_feedback=off --label shards-ef-off`.

Each mode runs one local cluster (coordinator, on-demand nodes ps-a and ps-b that host the two
shards and their backups, spot nodes w-1 and w-2 that train): `bench/_scale_user.py:mlp`, a
3584-wide, 10-layer MLP. A thread reads /proc every 0.2 s for every process in the cluster's
process groups (agents, their fork servers, the role processes forked from those, the
coordinator) and keeps each one's peak resident set (VmHWM). Role processes are told apart by
their parent (the agent's fork server) and, for shards, by the port they listen on. A role's
memory is counted above the fork server's own (a process that imported torch and the role code
and built nothing, which every role is forked from); a bare `import torch` is reported beside it.

The step's parts come from the workers' cumulative timers (step_compute_s, step_exchange_s with
step_encode_s / step_decode_s inside it, step_assemble_s) and the shards' ps_apply_s. Push+pull:
a shard in its own process and a ShardClient here, against a ROUTER echo in its own process and
a DEALER here carrying the same frames, in the same run. Serving during checkpoints: a thread
sends STATS to shard 0's primary every 50 ms and records the latency; the shards report the
serve-thread time of each snapshot (ckpt_snapshot_s).

Writes bench/results/scale_model.{json,md}, a --label run bench/out/scale_model_<label>.{json,md}; a run
of some modes replaces only those modes' rows in its file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from bench._report import record_line, report_path, write_report
from bench._scale_user import mlp
from bench._wait import wait
from gossamer.core.experiment import Experiment
from gossamer.paramserver import ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.tools.local_cluster import LocalCluster
from gossamer.transport.frames import FrameLimits, Message, encode

BENCH = Path(__file__).resolve().parent

MB = 1e6
T0 = time.monotonic()
BASE: dict[str, Any] = {
    "model": "bench._scale_user:mlp", "dataset": "bench._scale_user:data", "lr": 0.01, "momentum": 0.9, "batch_size": 32,
    "num_ps_shards": 2, "ps_backup": True, "min_workers": 2, "max_workers": 2, "eval_every": 0,
}
MODES: dict[str, dict[str, Any]] = {
    "async": {"mode": "async", "total_steps": 24, "checkpoint_every": 8},
    "sync": {"mode": "sync", "total_steps": 12},
    "diloco": {"mode": "diloco", "inner_steps": 4, "total_steps": 16, "momentum": 0.0},
}


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# /proc
# ------------------------------------------------------------------------------------------
def _status_kb(pid: int | str, *keys: str) -> dict[str, int]:
    """`keys` of /proc/PID/status in kB (0 where absent)."""
    out = dict.fromkeys(keys, 0)
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in out:
                out[key] = int(rest.split()[0])
    return out


def _stat(pid: int | str) -> tuple[int, int]:
    """(ppid, process group) of `pid`."""
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    fields = s[s.rfind(")") + 2:].split()
    return int(fields[1]), int(fields[2])


def _listening() -> dict[int, int]:
    """Socket inode -> port of every listening TCP socket."""
    out: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A":
                out[int(parts[9])] = int(parts[1].rsplit(":", 1)[1], 16)
    return out


def _ports(pid: int, listening: dict[int, int]) -> set[int]:
    ports = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                port = listening.get(int(target[8:-1]))
                if port:
                    ports.add(port)
    except OSError:
        pass
    return ports


class ProcWatch(threading.Thread):
    """Every `period` s: the peak RSS (VmHWM) of every process in the process groups `groups()`."""

    def __init__(self, groups: Any, period: float = 0.2) -> None:
        super().__init__(daemon=True, name="procwatch")
        self.groups, self.period = groups, period
        self.procs: dict[int, dict[str, Any]] = {}
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.period)

    def sample(self) -> None:
        groups = set(self.groups())
        listening = _listening()
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                ppid, pgrp = _stat(d)
                if pgrp not in groups:
                    continue
                kb = _status_kb(d, "VmHWM", "RssAnon", "RssFile")
                rec = self.procs.setdefault(int(d), {"ppid": ppid, "pgrp": pgrp, "hwm_kb": 0, "anon_kb": 0,
                                                     "file_kb": 0, "ports": set(),
                                                     "cmd": Path(f"/proc/{d}/cmdline").read_bytes()})
                rec["hwm_kb"] = max(rec["hwm_kb"], kb["VmHWM"])
                # sampled, not the kernel's own peak: what of the resident set is anonymous (the role's
                # tensors, heaps) and what file pages (shared libraries, shared with the host's others)
                rec["anon_kb"] = max(rec["anon_kb"], kb["RssAnon"])
                rec["file_kb"] = max(rec["file_kb"], kb["RssFile"])
                if not rec["ports"]:
                    rec["ports"] = _ports(int(d), listening)
            except (OSError, ValueError, IndexError):
                continue

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.sample()


def torch_baseline_mb() -> dict[str, float]:
    """Peak RSS of a fresh process that imported torch (and, second, the role code) and built nothing."""
    out = {}
    for label, code in (("import torch", "import torch"),
                        ("import torch + role code", "import torch, torch.distributed, gossamer.node.roles, "
                         "gossamer.node.server_role, gossamer.node.worker_role")):
        res = subprocess.run([sys.executable, "-c", code + "\nprint(open('/proc/self/status').read())"],
                             capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        hwm = next(int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("VmHWM:"))
        out[label] = kb_to_mb(hwm)
    return out


def kb_to_mb(kb: int) -> float:
    return kb * 1024 / MB


# ------------------------------------------------------------------------------------------
# One cluster per mode
# ------------------------------------------------------------------------------------------


class Prober(threading.Thread):
    """STATS to one shard endpoint every 50 ms: (time, latency s) samples."""

    def __init__(self, exp_id: str, plan: ShardPlan, endpoint: str, shard: int) -> None:
        super().__init__(daemon=True, name="prober")
        self.exp_id, self.plan, self.endpoint, self.shard = exp_id, plan, endpoint, shard
        self.samples: list[tuple[float, float]] = []
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        client = ShardClient(experiment=self.exp_id, sender="probe", plan=self.plan,
                             endpoints={self.shard: self.endpoint}, chunks=[c.index for c in
                                                                            self.plan.chunks_of_shard(self.shard)],
                             timeout_s=30.0)
        try:
            while not self._halt.is_set():
                t0 = time.perf_counter()
                try:
                    client.stats(self.shard)
                except Exception:  # noqa: BLE001 — the shard ended: stop probing
                    return
                self.samples.append((time.time(), time.perf_counter() - t0))
                self._halt.wait(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=35)


def _last_values(metrics: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The newest value of every metric, by source."""
    out: dict[str, dict[str, float]] = {}
    for m in sorted(metrics, key=lambda m: m["time_unix"]):
        vals = out.setdefault(m["source"], {})
        vals.update({k: v for k, v in m.items() if isinstance(v, int | float) and k not in ("time_unix", "step")})
    return out


def run_mode(mode: str, steps: int | None, plan: ShardPlan, model_bytes: int, label: str,
             fields: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {**BASE, **MODES[mode], **(fields or {}), "name": f"scale-{mode}"}
    if steps:
        spec["total_steps"] = steps
    env = {"PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    with LocalCluster(env=env, stop_grace_s=10.0) as cluster:
        watch = ProcWatch(lambda: [p.pid for p in cluster._started])  # noqa: SLF001 — every group it started
        try:
            cluster.start_coordinator()
            for name, spot in (("ps-a", False), ("ps-b", False), ("w-1", True), ("w-2", True)):
                cluster.add_node(name, spot=spot)
                if name == "ps-a":
                    cluster.wait_joined("ps-a")  # joined first: preferred for the shards
            cluster.wait_joined("ps-a", "ps-b", "w-1", "w-2")
            client = cluster.client()
            t_submit = time.time()
            job = client.submit(spec)
            say(f"{mode}: submitted {job.id}")

            def serving() -> dict[str, Any] | None:
                st = job.status()
                ps = [r for r in st["roles"] if r["role"] == "ps" and r["endpoint"]]
                if st["state"] in ("failed", "cancelled", "completed"):
                    raise RuntimeError(f"{mode}: experiment ended early: {st}")
                return st if len(ps) == 4 and any(r["role"] == "worker" for r in st["roles"]) else None

            st = wait(serving, 300, "four shard replicas serving")
            roles = st["roles"]
            prim0 = next(r for r in roles if r["role"] == "ps" and r["index"] == 0 and r["replica"] == 0)
            prober = Prober(job.id, plan, prim0["endpoint"], 0)
            t_first = None
            while True:
                st = job.status()
                if t_first is None and st.get("version", 0) or t_first is None and any(
                        m.get("updates", 0) for m in job.metrics(since_unix=t_submit)):
                    t_first = time.time()
                if st["state"] in ("completed", "failed", "cancelled"):
                    break
                time.sleep(0.5)
            t_end = time.time()
            prober.stop()
            time.sleep(1.5)
            metrics = job.metrics(since_unix=t_submit)
            events = job.events(since_unix=t_submit)
            say(f"{mode}: {st['state']} in {t_end - t_submit:.1f} s")
            if st["state"] != "completed":
                raise RuntimeError(f"{mode}: {st['state']}: {[e['message'] for e in events][-10:]}")
        finally:
            watch.stop()
            client_ = locals().get("client")
            if client_ is not None:
                client_.close()
        coord_pid = cluster.coordinator.pid if cluster.coordinator else -1
        agents = {p.pid: name for name, p in cluster.nodes.items()}
    return {"mode": mode, "label": label, "spec": spec, "roles": roles, "procs": watch.procs, "agents": agents,
            "coordinator": coord_pid, "metrics": metrics, "events": events, "probe": prober.samples,
            "seconds": t_end - t_submit, "first_update_s": (t_first or t_end) - t_submit,
            "versions": int(st.get("version", 0) or spec["total_steps"])}


def memory_rows(run: dict[str, Any], plan: ShardPlan, model_bytes: int, torch_mb: float) -> list[dict[str, Any]]:
    """One row per process: its role, peak RSS, and above the fork server's (its torch baseline)."""
    procs, agents = run["procs"], run["agents"]
    spec = run["spec"]
    # A shard's state: its values and the optimizer's per-value buffers (SGD momentum: one).
    momentum = spec.get("outer_momentum", 0.9) if spec["mode"] == "diloco" else spec.get("momentum", 0.0)
    factor = 2 if momentum else 1
    port_role = {int(r["endpoint"].rsplit(":", 1)[1]): r for r in run["roles"] if r["role"] == "ps" and r["endpoint"]}
    forkservers = {pid: rec for pid, rec in procs.items() if b"forkserver" in rec["cmd"] and rec["ppid"] in agents}
    rows: list[dict[str, Any]] = []
    host_sum: dict[str, list[float]] = {}
    for pid, rec in sorted(procs.items()):
        if not rec["hwm_kb"]:
            continue  # seen only as it exited (no memory map left to read)
        peak = kb_to_mb(rec["hwm_kb"])
        node = agents.get(rec["pgrp"], "")
        fs = forkservers.get(rec["ppid"])
        base = kb_to_mb(fs["hwm_kb"]) if fs is not None else torch_mb
        row: dict[str, Any] = {"label": run["label"], "mode": run["mode"], "node": node or "-"}
        if rec.get("anon_kb"):
            row.update(sampled_anon_mb=kb_to_mb(rec["anon_kb"]), sampled_file_mb=kb_to_mb(rec["file_kb"]))
        if pid == run["coordinator"]:
            row["role"] = "coordinator"
        elif pid in agents:
            row["role"] = "agent"
        elif pid in forkservers:
            row["role"] = "fork server (torch baseline)"
        elif b"resource_tracker" in rec["cmd"]:
            row["role"] = "resource tracker"
        elif fs is not None:
            ps = next((port_role[p] for p in rec["ports"] if p in port_role), None)
            if ps is not None:
                held = plan.shard_numel(ps["index"]) * 4
                row["role"] = f"ps{ps['index']} {'primary' if ps['replica'] == 0 else 'backup'}"
                row.update(peak_mb=peak, above_torch_mb=peak - base, held_mb=held / MB,
                           x_held=(peak - base) * MB / held, x_state=(peak - base) * MB / (held * factor))
                host_sum.setdefault(node, [0.0, 0.0, 0.0])
                host_sum[node][0] += peak - base
                host_sum[node][1] += held / MB
                host_sum[node][2] += peak
                rows.append(row)
                continue
            if peak <= base:  # the fork server's warm-up probe (`warm_up`): forked, built nothing, exited
                row.update(role="warm-up probe", peak_mb=peak)
                rows.append(row)
                continue
            row["role"] = "worker"
            row.update(peak_mb=peak, above_torch_mb=peak - base, held_mb=model_bytes / MB,
                       x_held=(peak - base) * MB / model_bytes)
            rows.append(row)
            continue
        else:
            row["role"] = "other: " + rec["cmd"].replace(b"\0", b" ").decode(errors="replace")[:60]
        row.update(peak_mb=peak)
        rows.append(row)
    for node, (above, held, peak) in sorted(host_sum.items()):
        rows.append({"label": run["label"], "mode": run["mode"], "node": node, "role": "shard host (its ps roles)",
                     "peak_mb": peak, "above_torch_mb": above, "held_mb": held, "x_held": above / held,
                     "x_state": above / (held * factor)})
    return rows


def step_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per worker and shard: the step's parts per update, from the cumulative timers they report."""
    last = _last_values(run["metrics"])
    names = {r["node_id"]: r["node"] for r in run["roles"]}
    replica = {(r["node_id"], f"ps{r['index']}"): "primary" if r["replica"] == 0 else "backup"
               for r in run["roles"] if r["role"] == "ps"}
    rows = []
    for key, v in sorted(last.items()):
        node_id, _, tail = key.partition("/")
        src = f"{names.get(node_id, node_id)}/{tail}" + (f" {replica[node_id, tail]}" if (node_id, tail) in replica
                                                          else "")
        if "step_compute_s" in v:
            n = max(1.0, v.get("updates", 0) or 0)
            rows.append({
                "label": run["label"], "mode": run["mode"], "source": src, "steps": int(n),
                "compute_ms": 1000 * v["step_compute_s"] / n,
                "encode_ms": 1000 * v.get("step_encode_s", 0) / n,
                "transfer_ms": 1000 * (v["step_exchange_s"] - v.get("step_encode_s", 0) - v.get("step_decode_s", 0)) / n,
                "decode_ms": 1000 * v.get("step_decode_s", 0) / n,
                "assemble_ms": 1000 * v.get("step_assemble_s", 0) / n,
            })
        elif "ps_apply_s" in v and v.get("ps_updates"):
            rows.append({"label": run["label"], "mode": run["mode"], "source": src, "steps": int(v["ps_updates"]),
                         "apply_ms": 1000 * v["ps_apply_s"] / v["ps_updates"],
                         "cow_copies": int(v.get("ps_cow_copies", 0)),
                         # a primary's updates acknowledged while its backup was detached (it re-syncs after)
                         "unreplicated": int(v.get("ps_unreplicated", 0)),
                         "ckpt_saved": int(v.get("ckpt_saved", 0)),
                         "ckpt_snapshot_ms": 1000 * v.get("ckpt_snapshot_s", 0) / max(1.0, v.get("ckpt_saved", 0)
                                                                                      + v.get("ckpt_skipped", 0)),
                         "ckpt_write_s": v.get("ckpt_write_s", 0.0)})
    return rows


# ------------------------------------------------------------------------------------------
# Push+pull against raw ZMQ (same bytes, same frames, loopback TCP, server in its own process)
# ------------------------------------------------------------------------------------------
def _shard_server(port_q: Any, stop: Any, spec: dict[str, Any]) -> None:
    from gossamer.engine.allocator import mmap_large_allocations

    # as a shard role process starts (`_role_process.setup`): large buffers by mmap, one torch thread
    mmap_large_allocations()
    torch.set_num_threads(1)
    exp = Experiment.from_dict(spec)
    with torch.device("meta"):
        model = mlp()
    plan = ShardPlan.for_experiment(model, exp)
    init = {c.index: torch.zeros(c.numel) for c in plan.chunks_of_shard(0)}
    server = ShardServer(ShardConfig.for_experiment(exp, "pp", 0), plan, init)
    port_q.put(server.bind())
    thread = server.start()
    stop.wait()
    port_q.put(server.stats()["apply_s"])
    server.close()
    del thread


def _raw_echo(port_q: Any, stop: Any, max_bytes: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    port_q.put(f"tcp://127.0.0.1:{port}")
    while not stop.is_set():
        if sock.poll(100):
            frames = sock.recv_multipart(copy=False)
            sock.send_multipart(frames, copy=False)
    sock.close(linger=0)
    ctx.term()


def push_pull_vs_raw(plan: ShardPlan, rounds: int = 8) -> dict[str, Any]:
    """Median round trips, alternating gossamer and raw ZMQ round by round (the machine's load hits both alike)."""
    spec = {**BASE, **MODES["async"], "name": "pp", "checkpoint_every": 0}
    ctx = mp.get_context("spawn")
    mine = [c.index for c in plan.chunks_of_shard(0)]
    numel = plan.shard_numel(0)
    grads = {i: torch.full((plan.chunks[i].numel,), 1e-6) for i in mine}
    q_ps, stop_ps, q_raw, stop_raw = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
    ps = ctx.Process(target=_shard_server, args=(q_ps, stop_ps, spec))
    raw = ctx.Process(target=_raw_echo, args=(q_raw, stop_raw, FrameLimits.for_values(numel).max_message_bytes))
    ps.start()
    raw.start()
    client = ShardClient(experiment="pp", sender="bench:0", plan=plan, endpoints={0: q_ps.get(timeout=120)},
                         chunks=mine)
    client.hello(fresh=True)
    client.pull()
    # The same frames (header + one per chunk) through a DEALER to a ROUTER that echoes them.
    frames = encode(Message(op="PUSH", experiment="pp", shard=0, sender="bench:0", meta={"rid": 1},
                            tensors={f"c{i}": g for i, g in grads.items()}))
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(q_raw.get(timeout=120))
    ours, theirs = [], []
    for clock in range(rounds + 1):
        t0 = time.perf_counter()
        client.push_pull(grads, clock=clock, basis={0: clock})
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sock.send_multipart(frames, copy=False)
        sock.recv_multipart(copy=False)
        theirs.append(time.perf_counter() - t0)
    sock.close(linger=0)
    zctx.term()
    client.leave()
    client.close()
    stop_ps.set()
    stop_raw.set()
    apply_s = q_ps.get(timeout=60)
    ps.join(timeout=30)
    raw.join(timeout=30)
    out: dict[str, Any] = {"bytes_each_way_mb": numel * 4 / MB, "rounds": rounds}
    out["gossamer_s"] = statistics.median(ours[1:])
    out["gossamer_apply_s"] = apply_s / (rounds + 1)
    out["gossamer_encode_s"] = client.encode_s / (rounds + 1)
    out["gossamer_decode_s"] = client.decode_s / (rounds + 1)
    out["raw_zmq_s"] = statistics.median(theirs[1:])
    out["ratio"] = out["raw_zmq_s"] / out["gossamer_s"]
    out["ratio_without_apply"] = out["raw_zmq_s"] / max(1e-9, out["gossamer_s"] - out["gossamer_apply_s"])
    return out


# ------------------------------------------------------------------------------------------
def checkpoint_row(run: dict[str, Any]) -> dict[str, Any]:
    lat = sorted(x for _, x in run["probe"])
    ck = [e for e in run["events"] if e["kind"] == "checkpoint"]
    if not lat:
        return {"label": run["label"], "mode": run["mode"], "probes": 0}
    training_s = run["seconds"] - run.get("first_update_s", 0.0)
    return {"label": run["label"], "mode": run["mode"], "probes": len(lat), "checkpoint_events": len(ck),
            "stats_p50_ms": 1000 * lat[len(lat) // 2], "stats_p99_ms": 1000 * lat[int(len(lat) * 0.99)],
            "stats_max_ms": 1000 * lat[-1],
            # From the first update seen (polled every 0.5 s) to the end: the run's update rate.
            "training_s": training_s, "updates_per_s": run.get("versions", 0) / training_s if training_s > 0 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default=None, help="a labelled run: written to bench/out/")
    ap.add_argument("--modes", default="async,sync,diloco")
    ap.add_argument("--steps", type=int, default=0, help="total_steps of each run (0: the mode's default)")
    ap.add_argument("--skip-push-pull", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an experiment field for every mode's spec (VALUE as JSON, else a string)")
    ap.add_argument("--render", action="store_true",
                    help="run nothing: rewrite the markdown from the JSON (results/, or out/ with --label)")
    args = ap.parse_args()
    if args.render:
        say(f"wrote {render(report_path('scale_model', args.label))}")
        return
    fields = dict(_field(item) for item in args.set)
    with torch.device("meta"):
        model = mlp()
    numel = sum(p.numel() for p in model.parameters())
    model_bytes = numel * 4
    exp = Experiment.from_dict({**BASE, "name": "plan", **MODES["async"]})
    plan = ShardPlan.for_experiment(model, exp)
    say(f"model: {numel / 1e6:.1f}M parameters, {model_bytes / MB:.0f} MB fp32; shards of "
        f"{plan.shard_numel(0) * 4 / MB:.0f} and {plan.shard_numel(1) * 4 / MB:.0f} MB")
    baselines = torch_baseline_mb()
    say(f"baselines: {baselines}")
    torch_mb = baselines["import torch + role code"]
    head = {"model_numel": numel, "model_mb": model_bytes / MB, "baselines_mb": baselines}
    for mode in filter(None, args.modes.split(",")):
        run = run_mode(mode, args.steps or None, plan, model_bytes, args.label or "current", fields)
        mem = memory_rows(run, plan, model_bytes, torch_mb)
        for r in mem:
            if "x_held" in r:
                say(f"  {r['node']:5s} {r['role']:28s} peak {r['peak_mb']:7.0f} MB, above torch "
                    f"{r['above_torch_mb']:7.0f} MB = {r['x_held']:.2f}x of {r['held_mb']:.0f} MB")
        save(args.label, {**head, "memory": mem, "steps": step_rows(run), "checkpoint": [checkpoint_row(run)],
                          "push_pull": []}, mode)
    if not args.skip_push_pull:
        pp = {"label": args.label or "current", **push_pull_vs_raw(plan)}
        say(f"push+pull: {pp}")
        save(args.label, {**head, "memory": [], "steps": [], "checkpoint": [], "push_pull": [pp]}, "push_pull")


def _field(item: str) -> tuple[str, Any]:
    """`FIELD=VALUE` of `--set`: VALUE read as JSON (numbers, true/false), else kept as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set wants FIELD=VALUE, got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def save(label: str | None, part: dict[str, Any], mode: str) -> None:
    """Put the rows of `mode` into the run's file (results/, or out/ for a labelled run), beside the other modes'
    rows of the same label (a run of some modes replaces only those), and rewrite the markdown."""
    path = report_path("scale_model", label)
    row_label = label or "current"
    old: dict[str, Any] = {}
    if path.exists():
        old = json.loads(path.read_text()).get("rows", [{}])[0]
    merged: dict[str, Any] = {k: v for k, v in part.items() if not isinstance(v, list)}
    for key in ("memory", "steps", "checkpoint", "push_pull"):
        keep = [r for r in old.get(key, []) if r.get("label") == row_label and r.get("mode", "push_pull") != mode]
        merged[key] = keep + part[key]
    merged["baselines_by_label"] = {row_label: part["baselines_mb"]}
    js, _ = write_report("scale_model", [merged], NOTES.format(model=part["model_mb"]), label=label)
    say(f"wrote {js} and {render(js)}")


NOTES = ("A {model:.0f} MB (fp32) MLP trained through real processes: 2 shards with backups on 2 on-demand nodes, "
         "2 spot workers. Memory: `peak_mb` a process's peak resident set (VmHWM); `above_torch_mb` that less the peak "
         "of the fork server every role is forked from (torch and the role code imported, nothing built: Baselines); "
         "`held_mb` what the role holds (a worker: the model; a shard: its parameters; a host: the shards and backups "
         "on it); `x_held` above_torch_mb over held_mb; `x_state` over a shard's whole state (parameters and momentum, "
         "2x its parameters); `sampled_anon_mb` / `sampled_file_mb` the largest RssAnon / RssFile the 0.2 s sampler "
         "saw. Step time, per update: a worker's compute, encode, transfer (the exchange less encode and decode), "
         "decode and assemble; a shard's apply, `cow_copies` (writes out of place for a send still reading the "
         "values), `unreplicated` (updates acknowledged while its backup was detached), checkpoints saved, "
         "serve-thread ms per snapshot and write seconds; a backup's `steps` are the updates it replayed before a "
         "detach (more than 3 s behind its primary). Serving: STATS round trips to shard 0's primary every 50 ms "
         "while checkpoints run; `updates_per_s` versions over the time from the first update seen. Push+pull: one "
         "shard's push and pull against a raw ZMQ echo of the same frames, medians; `ratio` raw over gossamer. On a "
         "shared 2-core machine: compare timings within one run. A label naming fields ran with those experiment "
         "fields set (`--set`).")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(none)"]
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join(f"{r.get(c, ''):.2f}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                     for c in cols) + " |")
    return out


def render(js: Path) -> Path:
    """Write the markdown of a results JSON beside it (`--render`: again, from the JSON alone); returns its path."""
    d = json.loads(js.read_text())
    record = (record_line(d) if "commit" in d
              else f"_Host {d['host']}, {d['cpus']} CPUs; the commit and the load were not recorded._")
    md = js.with_suffix(".md")
    md.write_text(_markdown(d["rows"][0], d["notes"], f"_{d['time']}, Python {d['python']}._", record))
    return md


def _markdown(m: dict[str, Any], notes: str, stamp: str, record: str) -> str:
    lines = ["# scale_model", "", stamp, record, "", notes, "",
             f"Baselines (peak RSS, MB): {json.dumps(m['baselines_by_label'])}", "",
             "## Memory per role", ""]
    lines += _table([r for r in m["memory"] if "x_held" in r])
    lines += ["", "## Other processes", ""]
    lines += _table([r for r in m["memory"] if "x_held" not in r])
    lines += ["", "## Step time (per update)", ""]
    lines += _table(m["steps"])
    lines += ["", "## Serving while checkpointing (STATS to shard 0's primary every 50 ms)", ""]
    lines += _table(m["checkpoint"])
    lines += ["", "## Push+pull of one shard (both ways) against raw ZMQ, same frames", ""]
    lines += _table(m["push_pull"])
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
