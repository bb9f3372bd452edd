"""Recovery times on a local cluster (digits, async, 1 PS shard + backup, 3 spot workers), with a
stop-the-world restart-from-checkpoint baseline measured in the same run.

    python -m bench.recovery [--quick] [--log-dir DIR]

One cluster (heartbeat 0.5 s, lease 5 s): coordinator, "ps-a" (on-demand, joined first: the
primary), "ps-b" (on-demand: the backup), three spot workers. Measured:

1. detection: kill -9 of a worker node -> the coordinator's "lost" event;
2. throughput recovery after that kill: 1 s sliding-window version rate of the primary shard
   back to >= 90 % of (N-1)/N of the rate before; worst gap between version increments;
3. `worker join` -> the new node's first applied update (shard STATS "applied"), from the
   add_node call, from the coordinator's join / "joins as worker" events, from the role
   process start (/proc) and from the worker's "ready" event;
4. kill -9 of the primary shard's node -> the backup's version advances / "promote" event;
5. checkpoint overhead: checkpoint_every=100 vs 0 (alternating runs), and the shards' own
   ckpt_snapshot_s over wall time (target <= 3.5 %);
6. the baseline: cancel + resubmit of an identical experiment until its first step (the
   stop-the-world restart torchrun-elastic does), plus the steps redone since the last
   checkpoint. gossamer cannot resume a cancelled job, so the baseline is MODELLED from these
   measured restart and step-rate numbers.

Writes bench/results/recovery.{json,md} (--quick: bench/out/recovery_quick.*); node logs stay under --log-dir (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench._report import write_report
from bench._wait import wait
from gossamer import Client
from gossamer.examples.digits import mlp
from gossamer.paramserver import ShardClient, ShardPlan
from gossamer.tools.local_cluster import LocalCluster

CKPT_EVERY = 100
SPEC: dict[str, Any] = {
    "name": "recovery", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
    "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "ps_backup": True,
    "min_workers": 3, "max_workers": 3, "total_steps": 100_000_000, "eval_every": 0,
    "checkpoint_every": CKPT_EVERY,
}
T0 = time.monotonic()
PLAN = ShardPlan.for_module(mlp(), 1)


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Sampling a shard's STATS
# ------------------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Polls one shard endpoint's STATS every `period` s: samples of (time, version, applied, primary)."""

    def __init__(self, exp_id: str, endpoint: str, period: float = 0.05) -> None:
        super().__init__(daemon=True, name=f"sampler-{endpoint}")
        self.exp_id, self.endpoint, self.period = exp_id, endpoint, period
        self.samples: list[tuple[float, int, dict[str, int], bool]] = []
        self.errors = 0
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        client: ShardClient | None = None
        while not self._halt.is_set():
            t0 = time.time()
            try:
                if client is None:
                    client = ShardClient(experiment=self.exp_id, sender="observer", plan=PLAN,
                                         endpoints={0: self.endpoint}, timeout_s=2.0)
                st = client.stats(0)
                t1 = time.time()
                self.samples.append(((t0 + t1) / 2, int(st["version"]), dict(st.get("applied", {})),
                                     bool(st.get("primary", True))))
            except Exception:  # noqa: BLE001 — a dead or restarting shard: keep trying
                self.errors += 1
                if client is not None:
                    client.close()
                client = None
            self._halt.wait(max(0.0, self.period - (time.time() - t0)))
        if client is not None:
            client.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def latest(self) -> tuple[float, int, dict[str, int], bool] | None:
        return self.samples[-1] if self.samples else None

    def wait_for(self, pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
        """The first new sample satisfying `pred`."""
        deadline = time.monotonic() + timeout
        seen = len(self.samples)
        while time.monotonic() < deadline:
            while seen < len(self.samples):
                s = self.samples[seen]
                seen += 1
                if pred(s):
                    return s
            time.sleep(0.01)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} on {self.endpoint}")


def rate(samples: list[Any], t0: float, t1: float) -> float:
    """Versions per second between the first sample at/after t0 and the last at/before t1."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
        return float("nan")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def window_recovery(samples: list[Any], t_event: float, target: float, window: float = 1.0) -> float | None:
    """Seconds from t_event to the end of the first `window`-s window (lying wholly after t_event)
    whose version rate is >= target. The floor is `window`: no dip at all reads as ~1.0 s."""
    post = [s for s in samples if s[0] >= t_event]
    i = 0
    for j in range(len(post)):
        while i + 1 < j and post[i + 1][0] <= post[j][0] - window:
            i += 1
        if post[j][0] - post[i][0] < window * 0.95:
            continue
        r = (post[j][1] - post[i][1]) / (post[j][0] - post[i][0])
        if r >= target:
            return post[j][0] - t_event
    return None


def worst_gap(samples: list[Any], t_event: float, t_end: float) -> float:
    """Longest time without a version increment in [t_event, t_end] (resolution: the poll period)."""
    post = [s for s in samples if t_event <= s[0] <= t_end]
    if not post:
        return float("nan")
    last_change, v, gap = t_event, post[0][1], 0.0
    for t, ver, *_ in post[1:]:
        if ver > v:
            gap = max(gap, t - last_change)
            last_change, v = t, ver
    return max(gap, post[-1][0] - last_change)


def version_at(samples: list[Any], t: float) -> int:
    before = [s for s in samples if s[0] <= t]
    return before[-1][1] if before else 0


# ------------------------------------------------------------------------------------------
# /proc: when did a node's role process start (independent of the coordinator's clock)
# ------------------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _boot_unix() -> float:
    with open("/proc/uptime") as f:
        return time.time() - float(f.read().split()[0])


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    return s[s.rfind(")") + 2:].split()  # fields from #3 (state) on


def proc_start_unix(pid: int) -> float:
    return _boot_unix() + int(_stat(pid)[19]) / _TICK  # field #22: starttime in ticks since boot


def _children(pid: int) -> list[tuple[int, bytes]]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if int(_stat(int(d))[1]) == pid:
                out.append((int(d), Path(f"/proc/{d}/cmdline").read_bytes()))
        except (OSError, ValueError, IndexError):
            continue
    return out


def role_children(agent_pid: int) -> list[int]:
    """Role processes of a node agent: spawned ones (cold) or forked by its fork server (warm roles)."""
    out = []
    for pid, cmd in _children(agent_pid):
        if b"forkserver" in cmd:
            out += [child for child, _ in _children(pid)]
        elif b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(pid)
    return out


# ------------------------------------------------------------------------------------------
# Cluster helpers
# ------------------------------------------------------------------------------------------


def node_id(client: Client, name: str) -> str:
    return next(n["id"] for n in client.nodes() if n["name"] == name and n["state"] != "lost")


def primary_role(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in status["roles"] if r["role"] == "ps" and r["replica"] == 0 and r["endpoint"]), None)


def backup_role(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in status["roles"] if r["role"] == "ps" and r["replica"] == 1 and r["endpoint"]), None)


def workers_of(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in status["roles"] if r["role"] == "worker"]


def first_event(events: list[dict[str, Any]], kind: str, contains: str = "", node: str = "",
                after: float = 0.0) -> dict[str, Any] | None:
    return next((e for e in events if e["kind"] == kind and contains in e["message"]
                 and (not node or e["node_id"] == node) and e["time_unix"] >= after), None)


def backup_synced(job: Any) -> bool:
    """The newest backup placement has been followed by a 'replicated' (backup attached) event."""
    events = job.events()
    placed = [e for e in events if e["kind"] == "reassign" and "backup of shard 0 placed" in e["message"]]
    since = placed[-1]["time_unix"] if placed else 0.0
    return first_event(events, "replicated", "backup attached", after=since) is not None


def stats_of(xs: list[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(st: dict[str, float] | None, unit: str = "s", digits: int = 2) -> str:
    if st is None:
        return "n/a"
    if st["n"] == 1:
        return f"{st['median']:.{digits}f} {unit} (n=1)"
    return f"{st['median']:.{digits}f} {unit} ({st['min']:.{digits}f}–{st['max']:.{digits}f}, n={st['n']})"


# ------------------------------------------------------------------------------------------
# Phases
# ------------------------------------------------------------------------------------------
def kill_worker_and_rejoin(cluster: LocalCluster, client: Client, job: Any, smp: Sampler, victim: str,
                           newcomer: str, pre_s: float, post_s: float) -> dict[str, Any]:
    st = job.status()
    n = len(workers_of(st))
    wait(lambda: smp.latest() and smp.samples[0][0] < time.time() - pre_s, 30, "pre-kill samples")
    t_kill = time.time()
    cluster.kill_node(victim)
    t_killed = time.time()
    time.sleep(post_s)
    rate_before = rate(smp.samples, t_kill - pre_s, t_kill)
    expected = rate_before * (n - 1) / n
    v_kill = version_at(smp.samples, t_kill)
    rec = window_recovery(smp.samples, t_kill, 0.9 * expected)
    gap = worst_gap(smp.samples, t_kill, t_kill + post_s)
    rate_after = rate(smp.samples, t_kill + 1.5, t_kill + post_s)
    lost = first_event(job.events(since_unix=t_kill - 1), "lost", f"node {victim} ", after=t_kill - 1)
    detect = lost["time_unix"] - t_kill if lost else None
    say(f"  killed {victim} (v={v_kill}, {n} workers, {rate_before:.0f} v/s before, {rate_after:.0f} after): "
        f"detected in {detect if detect is None else round(detect, 3)} s, rate back in "
        f"{rec if rec is None else round(rec, 2)} s, worst gap {gap:.3f} s")

    # ---- join of a replacement
    keys_before = set(smp.latest()[2])  # type: ignore[index]
    t_add = time.time()
    proc = cluster.add_node(newcomer, spot=True)
    first = smp.wait_for(lambda s: set(s[2]) - keys_before, 90, f"{newcomer}'s first applied update")
    t_first = first[0]
    role_pids = role_children(proc.pid)
    t_role = min(proc_start_unix(p) for p in role_pids) if role_pids else None
    t_agent = proc_start_unix(proc.pid)
    nid = node_id(client, newcomer)
    new_keys = sorted(set(first[2]) - keys_before)
    events = job.events(since_unix=t_add - 1)
    # node joins are not experiment events: the whole log
    ev_join = first_event(all_events(client, t_add - 1), "join", f"node {newcomer} ", after=t_add - 1)
    ev_assign = first_event(events, "reassign", f"node {newcomer} joins as worker", after=t_add - 1)
    ev_ready = first_event(events, "ready", "", node=nid, after=t_add - 1)
    out = {
        "victim": victim, "workers_before": n, "version_at_kill": v_kill, "rate_before": rate_before,
        "rate_after": rate_after, "expected_after": expected, "detect_s": detect,
        "lost_message": lost["message"] if lost else None, "recover_s": rec, "worst_gap_s": gap,
        "kill_call_s": t_killed - t_kill,
        "newcomer": newcomer, "new_sender": new_keys, "sender_matches_node": all(k.startswith(nid + ":") for k in new_keys),
        "join_from_add_s": t_first - t_add,
        "agent_exec_after_add_s": t_agent - t_add,
        "join_from_join_event_s": t_first - ev_join["time_unix"] if ev_join else None,
        "join_from_assign_event_s": t_first - ev_assign["time_unix"] if ev_assign else None,
        "join_from_role_start_s": t_first - t_role if t_role else None,
        "join_from_ready_event_s": t_first - ev_ready["time_unix"] if ev_ready else None,
        "add_to_join_event_s": ev_join["time_unix"] - t_add if ev_join else None,
        "add_to_role_start_s": t_role - t_add if t_role else None,
    }
    say(f"  {newcomer} joined: first applied update {out['join_from_add_s']:.2f} s after add_node "
        f"({_r(out['join_from_assign_event_s'])} s after 'joins as worker', {_r(out['join_from_role_start_s'])} s "
        f"after its role process started, {_r(out['join_from_ready_event_s'])} s after 'ready')")
    return out


def standby_takes_over(cluster: LocalCluster, client: Client, job: Any, smp: Sampler, victim: str,
                       standby: str) -> dict[str, Any]:
    """A warm idle node (joined earlier, its fork server ready) takes a killed worker's place: the
    spot pool's usual case, where a join's interpreter and imports are paid long before the kill."""
    cluster.add_node(standby, spot=True)
    log = cluster.log_dir / f"{standby}.log"
    wait(lambda: "role processes start warm" in (log.read_text(errors="replace") if log.exists() else ""), 90,
         f"{standby} warm")
    sid = node_id(client, standby)
    assert not [r for r in job.status()["roles"] if r.get("node") == standby], "the standby was given a role"
    time.sleep(1.0)  # its warm-up burst passes
    keys_before = set(smp.latest()[2])  # type: ignore[index]
    t_kill = time.time()
    cluster.kill_node(victim)
    first = smp.wait_for(lambda s: any(k.startswith(sid + ":") for k in set(s[2]) - keys_before), 90,
                         f"{standby}'s first applied update")
    events = job.events(since_unix=t_kill - 1)
    lost = first_event(events, "lost", f"node {victim} ", after=t_kill - 1)
    assign = first_event(events, "reassign", f"node {standby} joins as worker", after=t_kill - 1)
    out = {
        "victim": victim, "standby": standby,
        "kill_to_first_s": first[0] - t_kill,
        "kill_to_lost_s": lost["time_unix"] - t_kill if lost else None,
        "kill_to_assign_s": assign["time_unix"] - t_kill if assign else None,
        "assign_to_first_s": first[0] - assign["time_unix"] if assign else None,
    }
    say(f"  standby {standby} replaced {victim}: first applied update {out['kill_to_first_s']:.2f} s after the "
        f"kill ({_r(out['kill_to_assign_s'])} s to 'joins as worker', then {_r(out['assign_to_first_s'])} s)")
    return out


def _r(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def all_events(client: Client, since: float) -> list[dict[str, Any]]:
    from gossamer.v1 import coordinator_pb2 as pb

    resp = client._call(client._exp.ListEvents, pb.ListEventsRequest(since_unix=since))  # noqa: SLF001
    return [{"time_unix": e.time_unix, "kind": e.kind, "message": e.message, "node_id": e.node_id,
             "experiment_id": e.experiment_id} for e in resp.events]


def kill_primary(cluster: LocalCluster, client: Client, job: Any, smp: Sampler, spare: str,
                 pre_s: float, post_s: float) -> tuple[dict[str, Any], Sampler]:
    """Add an on-demand spare (it takes the new backup), then kill -9 the primary's node."""
    t_spare = time.time()
    cluster.add_node(spare)
    wait(lambda: any(n["name"] == spare and n["state"] == "ready" for n in client.nodes()), 60, f"{spare} ready")
    # The backup must be attached and synced, or the coordinator restores instead of promoting.
    wait(lambda: backup_synced(job), 120, "a synced backup")
    st = job.status()
    prim, back = primary_role(st), backup_role(st)
    assert prim and back, st["roles"]
    bsmp = Sampler(job.id, back["endpoint"])
    t_ready = time.time()
    wait(lambda: len(bsmp.samples) > 10 and time.time() > t_ready + pre_s, 30, "pre-kill samples")
    n = len(workers_of(st))
    t_kill = time.time()
    cluster.kill_node(prim["node"])
    time.sleep(post_s)
    rate_before = rate(smp.samples, t_kill - pre_s, t_kill)
    v_prim = version_at(smp.samples, t_kill)
    v_back = version_at(bsmp.samples, t_kill)
    settle = t_kill + 0.25  # REPLICATEs already in flight land within ms; then the backup is flat
    plateau = version_at(bsmp.samples, settle)
    adv = next((s for s in bsmp.samples if s[0] > settle and s[1] > plateau), None)
    flip = next((s for s in bsmp.samples if s[0] > t_kill and s[3]), None)
    rec = window_recovery(bsmp.samples, t_kill, 0.9 * rate_before)
    gap = worst_gap(bsmp.samples, t_kill, t_kill + post_s)
    events = job.events(since_unix=t_kill - 1)
    lost = first_event(events, "lost", f"node {prim['node']} ", after=t_kill - 1)
    promote = first_event(events, "promote", "", after=t_kill - 1)
    placed = first_event(events, "reassign", "backup of shard 0 placed", after=t_kill - 1)
    out = {
        "killed": prim["node"], "backup": back["node"], "spare": spare, "workers": n,
        "rate_before": rate_before, "primary_version_at_kill": v_prim, "backup_version_at_kill": v_back,
        "backup_plateau_version": plateau,
        "detect_s": lost["time_unix"] - t_kill if lost else None,
        "promote_event_s": promote["time_unix"] - t_kill if promote else None,
        "promote_message": promote["message"] if promote else None,
        "backup_primary_flag_s": flip[0] - t_kill if flip else None,
        "backup_advances_s": adv[0] - t_kill if adv else None,
        "recover_s": rec, "worst_gap_s": gap,
        "new_backup_event": placed["message"] if placed else None,
        "spare_added_s_before_kill": t_kill - t_spare,
    }
    say(f"  killed primary on {prim['node']} (v={v_prim}, backup at {v_back}): detected "
        f"{_r(out['detect_s'])} s, promote event {_r(out['promote_event_s'])} s, backup advances "
        f"{_r(out['backup_advances_s'])} s, rate back {_r(rec)} s, worst gap {gap:.2f} s")
    smp.stop()
    return out, bsmp


def start_job(client: Client, spec: dict[str, Any], prev: Any | None) -> tuple[Any, Sampler, dict[str, Any]]:
    """Cancel `prev` (if any), submit `spec`, wait for its first step: the stop-the-world restart."""
    t_cancel = time.time()
    if prev is not None:
        prev.cancel()
    t_submit = time.time()
    job = client.submit(spec)
    prim = wait(lambda: primary_role(job.status()), 120, "the primary shard", period=0.05)
    smp = Sampler(job.id, prim["endpoint"])
    first = smp.wait_for(lambda s: s[1] >= 1, 120, "the first step")
    running = first_event(job.events(), "running")
    return job, smp, {
        "restart_s": first[0] - t_cancel, "cancel_call_s": t_submit - t_cancel,
        "submit_to_first_step_s": first[0] - t_submit,
        "submit_to_running_s": running["time_unix"] - t_submit if running else None,
        "running_to_first_step_s": first[0] - running["time_unix"] if running else None,
    }


def measure_rate(job: Any, smp: Sampler, window: float, n_workers: int) -> dict[str, Any]:
    """Steady-state version rate over `window` s once every worker applies, and the primary's
    checkpoint snapshot time over wall time."""
    smp.wait_for(lambda s: len(s[2]) >= n_workers, 90, f"{n_workers} workers applying")
    time.sleep(1.0)
    t0 = time.time()
    time.sleep(window)
    t1 = time.time()
    r = rate(smp.samples, t0, t1)
    inside = [x for x in smp.samples if t0 <= x[0] <= t1]
    per_worker = {}
    if len(inside) >= 2:
        a, b = inside[0], inside[-1]
        per_worker = {k: (b[2][k] - a[2].get(k, b[2][k])) / (b[0] - a[0]) for k in b[2]}
    prim = primary_role(job.status())
    src = f"{prim['node_id']}/ps0" if prim else ""
    time.sleep(1.0)  # the shard reports once a second: let the window's last point arrive
    rows = [m for m in job.metrics(since_unix=t0 - 1.0) if m["source"] == src and "ckpt_snapshot_s" in m
            and m["time_unix"] <= t1 + 0.5]
    snap_frac = None
    if len(rows) >= 2 and rows[-1]["time_unix"] > rows[0]["time_unix"]:
        snap_frac = (rows[-1]["ckpt_snapshot_s"] - rows[0]["ckpt_snapshot_s"]) / (
            rows[-1]["time_unix"] - rows[0]["time_unix"])
    last = rows[-1] if rows else {}
    # The background save thread (DCP files + fsync) runs in the shard's process: its busy share.
    save_busy = None
    if len(rows) >= 2 and "ckpt_saved" in rows[-1] and rows[-1]["time_unix"] > rows[0]["time_unix"]:
        per_save = statistics.median(m["ckpt_write_s"] for m in rows if m.get("ckpt_write_s"))  \
            if any(m.get("ckpt_write_s") for m in rows) else 0.0
        save_busy = (rows[-1]["ckpt_saved"] - rows[0]["ckpt_saved"]) / (
            rows[-1]["time_unix"] - rows[0]["time_unix"]) * per_save
    return {"rate": r, "window_s": t1 - t0, "snapshot_frac": snap_frac, "save_busy_frac": save_busy,
            "per_worker_rate": per_worker,
            "ckpt_saved": last.get("ckpt_saved"), "ckpt_skipped": last.get("ckpt_skipped"),
            "ckpt_write_s": last.get("ckpt_write_s"), "ckpt_snapshot_s_total": last.get("ckpt_snapshot_s")}


# ------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (~3 min instead of ~8)")
    ap.add_argument("--log-dir", default="", help="node logs (default: a new /tmp/gossamer-recovery-* dir, kept)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kills = 2 if args.quick else 4
    failovers = 1 if args.quick else 2
    standbys = 2 if args.quick else 4
    pairs = 1 if args.quick else 3
    window = 4.0 if args.quick else 6.0
    pre_s, post_s = 3.0, 4.0
    settle = 3.0 if args.quick else 5.0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gossamer-recovery-"))
    say(f"node logs in {log_dir}")
    raw: dict[str, Any] = {"kills": [], "standbys": [], "failovers": [], "restarts": [], "ckpt_runs": [], "loadavg": []}

    def load(phase: str) -> None:  # other work on this machine shows here (rates are CPU-bound)
        raw["loadavg"].append({"phase": phase, "t": round(time.monotonic() - T0, 1), "load1": os.getloadavg()[0]})
    coord_totals: dict[str, Any] = {}

    with LocalCluster(heartbeat_interval=0.5, lease_timeout=5.0, log_dir=log_dir) as cluster:
        address = cluster.start_coordinator(port=0)
        client = Client(address)
        cluster.add_node("ps-a")
        wait(lambda: len(client.nodes()) == 1, 60, "ps-a")
        cluster.add_node("ps-b")
        spot = ["w0", "w1", "w2"]
        for name in spot:
            cluster.add_node(name, spot=True)
        wait(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 5, 60, "five nodes")
        say("cluster up: ps-a, ps-b (on-demand), w0-w2 (spot)")
        load("start")
        job, smp, first = start_job(client, SPEC, None)
        say(f"{job.id}: first step {first['submit_to_first_step_s']:.2f} s after submit")
        smp.wait_for(lambda s: len(s[2]) >= 3, 90, "3 workers applying")
        time.sleep(settle)  # the last worker's start-up CPU burst, then steady state
        st = job.status()
        assert (primary_role(st)["node"], backup_role(st)["node"]) == ("ps-a", "ps-b"), st["roles"]  # type: ignore[index]

        # ---- 1-3: worker kills and joins
        nxt = 3
        for i in range(kills):
            victim = workers_of(job.status())[0]["node"]
            say(f"worker kill {i + 1}/{kills}")
            load(f"kill {i + 1}")
            raw["kills"].append(kill_worker_and_rejoin(cluster, client, job, smp, victim, f"w{nxt}", pre_s, post_s))
            nxt += 1
            time.sleep(1.0 + pre_s)  # the newcomer's start-up burst passes; then a clean pre-kill window

        # ---- 3b: a warm standby (idle spot node) takes each killed worker's place
        for i in range(standbys):
            victim = workers_of(job.status())[0]["node"]
            say(f"standby takeover {i + 1}/{standbys}")
            load(f"standby {i + 1}")
            raw["standbys"].append(standby_takes_over(cluster, client, job, smp, victim, f"w{nxt}"))
            nxt += 1
            time.sleep(1.0 + pre_s)

        # ---- 4: primary failovers (a spare on-demand node takes each new backup)
        for i in range(failovers):
            say(f"primary kill {i + 1}/{failovers}")
            load(f"failover {i + 1}")
            out, smp = kill_primary(cluster, client, job, smp, f"ps-{chr(ord('c') + i)}", pre_s, post_s)
            raw["failovers"].append(out)
        coord_totals = {k: v for k, v in job.status()["metrics"].items()
                        if k in ("detect_s_last", "detect_s_max", "nodes_lost", "nodes_left", "promotions", "restores")}
        events_e1 = job.events()
        smp.stop()

        # ---- 5 + 6: identical resubmits (restart cost) and checkpoint on/off, alternating
        order = [CKPT_EVERY, 0] * pairs  # first run: identical to the one cancelled
        prev = job
        for k, every in enumerate(order):
            spec = {**SPEC, "checkpoint_every": every}
            load(f"run {k + 1}")
            job, smp, rs = start_job(client, spec, prev)
            rs["checkpoint_every"] = every
            raw["restarts"].append(rs)
            m = measure_rate(job, smp, window, 3)
            m["checkpoint_every"] = every
            raw["ckpt_runs"].append(m)
            say(f"run {k + 1}/{len(order)} checkpoint_every={every}: restart (cancel -> first step) "
                f"{rs['restart_s']:.2f} s (submit -> shards serving {_r(rs['submit_to_running_s'])} s, then "
                f"workers -> first step {_r(rs['running_to_first_step_s'])} s); {m['rate']:.0f} versions/s; snapshot "
                f"{(m['snapshot_frac'] or 0) * 100:.2f} % of wall, save thread busy {(m['save_busy_frac'] or 0) * 100:.1f} %; "
                f"per worker {', '.join(f'{v:.0f}' for v in sorted(m['per_worker_rate'].values()))} steps/s")
            smp.stop()
            prev = job
        prev.cancel()
        load("end")
        roles_final = job.status()["roles"]
        client.close()
        say("closing the cluster (kill -9 of every node: a cancelled job's workers can linger up to 60 s)")
        for name in list(cluster.nodes):
            cluster.kill_node(name)
    raw["events_main"] = [{**e, "t_rel": e["time_unix"] - events_e1[0]["time_unix"]} for e in events_e1] \
        if events_e1 else []
    raw["coordinator_totals"] = coord_totals
    raw["final_roles"] = roles_final
    report(raw, args.quick, log_dir)


def report(raw: dict[str, Any], quick: bool, log_dir: Path) -> None:
    K, F, R, C = raw["kills"], raw["failovers"], raw["restarts"], raw["ckpt_runs"]
    detect = stats_of([k["detect_s"] for k in K])
    recover = stats_of([k["recover_s"] for k in K])
    gap = stats_of([k["worst_gap_s"] for k in K])
    j_add = stats_of([k["join_from_add_s"] for k in K])
    j_join = stats_of([k["join_from_join_event_s"] for k in K])
    j_assign = stats_of([k["join_from_assign_event_s"] for k in K])
    j_role = stats_of([k["join_from_role_start_s"] for k in K])
    j_ready = stats_of([k["join_from_ready_event_s"] for k in K])
    j_boot = stats_of([k["join_from_role_start_s"] - k["join_from_ready_event_s"] for k in K
                       if k["join_from_role_start_s"] is not None and k["join_from_ready_event_s"] is not None])
    j_agent = stats_of([k["add_to_join_event_s"] for k in K])
    S = raw.get("standbys", [])
    s_first = stats_of([x["kill_to_first_s"] for x in S])
    s_lost = stats_of([x["kill_to_lost_s"] for x in S])
    s_assign = stats_of([x["kill_to_assign_s"] for x in S])
    s_after = stats_of([x["assign_to_first_s"] for x in S])
    run_first = stats_of([r["running_to_first_step_s"] for r in R])
    loads = [x["load1"] for x in raw["loadavg"]]
    f_adv = stats_of([f["backup_advances_s"] for f in F])
    f_prom = stats_of([f["promote_event_s"] for f in F])
    f_rec = stats_of([f["recover_s"] for f in F])
    f_gap = stats_of([f["worst_gap_s"] for f in F])
    restart = stats_of([r["restart_s"] for r in R])
    restart_same = stats_of([r["restart_s"] for r in R if r["checkpoint_every"] == CKPT_EVERY])
    to_running = stats_of([r["submit_to_running_s"] for r in R])
    rate_full = stats_of([k["rate_before"] for k in K] + [f["rate_before"] for f in F])
    v_rate = rate_full["median"] if rate_full else float("nan")
    lost_steps = [k["version_at_kill"] % CKPT_EVERY for k in K] + [f["primary_version_at_kill"] % CKPT_EVERY for f in F]
    redo = stats_of([s / v_rate for s in lost_steps])
    redo_s = redo["median"] if redo else 0.0
    rst = restart["median"] if restart else float("nan")
    det = detect["median"] if detect else float("nan")
    base_worker = det + rst + redo_s  # no progress at all during detection + restart + redo
    base_join = rst + redo_s  # elastic scale-up restarts everyone; the redo is 0 if it waits for a checkpoint
    base_join_add = (j_agent["median"] if j_agent else 0.0) + base_join
    base_ps = (f_prom["median"] if f_prom else det) + rst + redo_s

    on = [c["rate"] for c in C if c["checkpoint_every"]]
    off = [c["rate"] for c in C if not c["checkpoint_every"]]
    pair_ovh = [100 * (1 - b / a) for b, a in zip(on, off, strict=False)]
    ovh = stats_of(pair_ovh)
    snap = stats_of([100 * c["snapshot_frac"] for c in C if c["checkpoint_every"] and c["snapshot_frac"] is not None])
    busy = stats_of([100 * c["save_busy_frac"] for c in C if c["checkpoint_every"] and c.get("save_busy_frac") is not None])
    per_save = stats_of([c["ckpt_write_s"] * 1e3 for c in C if c["checkpoint_every"] and c.get("ckpt_write_s")])

    def ratio(base: float, ours: dict[str, float] | None) -> str:
        if not ours or not ours["median"] or base != base:
            return ""
        return f"{base / ours['median']:.1f}x"

    rows = [
        {"metric": "detection: kill -9 of a worker node -> 'lost' event", "gossamer": fmt(detect),
         "restart-from-checkpoint baseline": f"{det:.2f} s (same detection assumed)", "baseline / gossamer": "1.0x",
         "note": "kill timestamp = time.time() just before SIGKILL of the node's process group; event time "
                 "from the coordinator. Stream closed + 2 heartbeat intervals (1 s) + reaper tick (0.5 s)"},
        {"metric": "worker kill -> 1 s window rate >= 90% of (N-1)/N x rate before", "gossamer": fmt(recover),
         "restart-from-checkpoint baseline": f"{base_worker:.2f} s (detect + restart + redo, 0 steps/s meanwhile)",
         "baseline / gossamer": ratio(base_worker, recover),
         "note": "shard version polled every 50 ms; the figure is the END of the first qualifying 1 s window "
                 "after the kill, so 1.0 s is the floor (= no visible dip: async survivors never wait)"},
        {"metric": "worker kill -> worst gap between version increments", "gossamer": fmt(gap, digits=3),
         "restart-from-checkpoint baseline": f"{det + rst:.2f} s (detect + restart: no step)",
         "baseline / gossamer": ratio(det + rst, gap), "note": "over the 4 s after the kill; resolution 50 ms"},
        {"metric": "updates rolled back per failure", "gossamer": "0 (shard state kept; replicated before ack)",
         "restart-from-checkpoint baseline": fmt(stats_of([float(s) for s in lost_steps]), "steps", 0),
         "baseline / gossamer": "",
         "note": f"baseline: shard version at the kill mod checkpoint_every={CKPT_EVERY}, redone at the measured "
                 f"full rate ({fmt(stats_of([s / v_rate for s in lost_steps]), digits=3)} of redo)"},
        {"metric": "join: add_node -> first applied update", "gossamer": fmt(j_add),
         "restart-from-checkpoint baseline": f"{base_join_add:.2f} s (agent start + restart + redo)",
         "baseline / gossamer": ratio(base_join_add, j_add),
         "note": "includes agent interpreter start + gRPC Join + assignment + role process spawn (python, torch "
                 "import, data + model build) + HELLO/PULL + first step + push; first time the new "
                 "'<node_id>:<index>' sender shows in the primary's STATS 'applied'"},
        {"metric": "join: coordinator 'join' event -> first applied update", "gossamer": fmt(j_join),
         "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": "excludes the agent's interpreter start and imports (the node is registered)"},
        {"metric": "join: 'joins as worker' (reassign) event -> first applied update", "gossamer": fmt(j_assign),
         "restart-from-checkpoint baseline": f"{base_join:.2f} s (stop-the-world restart + redo)",
         "baseline / gossamer": ratio(base_join, j_assign),
         "note": "excludes interpreter start + join handshake; includes assignment delivery, role spawn, torch "
                 "import, model build, first step. Baseline: torchrun-elastic restarts every worker on a "
                 "membership change"},
        {"metric": "join: role process start (/proc starttime) -> first applied update", "gossamer": fmt(j_role),
         "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": "measured outside gossamer: the spawned worker process's start time from /proc (10 ms ticks); "
                 "includes python + torch import, data + model build, HELLO/PULL, first step. Of it, role start -> "
                 f"'ready' (imports, data + model build) {fmt(j_boot)}; add_node -> coordinator 'join' event "
                 f"(agent interpreter + gRPC Join) {fmt(j_agent)}"},
        {"metric": "join: worker 'ready' event -> first applied update", "gossamer": fmt(j_ready),
         "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": "model built and role reported serving; left: HELLO + PULL + first step + push"},
        {"metric": "warm standby: kill -9 of a worker node -> the idle node's first applied update",
         "gossamer": fmt(s_first), "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": f"an idle spot node joined earlier (fork server warm) takes the killed worker's place: kill -> "
                 f"'lost' {fmt(s_lost)}, kill -> 'joins as worker' {fmt(s_assign)}"},
        {"metric": "warm standby: 'joins as worker' (reassign) event -> first applied update (target <= 2 s)",
         "gossamer": fmt(s_after), "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": "the warm-role target: assignment delivery, a role forked from the warm server, model "
                 "build, HELLO/PULL, first step, push"},
        {"metric": "PS failover: kill -9 primary node -> backup's version advances", "gossamer": fmt(f_adv),
         "restart-from-checkpoint baseline": f"{base_ps:.2f} s (detect + restart + redo)",
         "baseline / gossamer": ratio(base_ps, f_adv),
         "note": "backup endpoint polled every 50 ms; first version above its plateau (0.25 s after the kill): "
                 "detection, promotion, endpoint pushed to workers, their pushes re-sent and applied"},
        {"metric": "PS failover: kill -9 primary node -> 'promote' event", "gossamer": fmt(f_prom),
         "restart-from-checkpoint baseline": "", "baseline / gossamer": "", "note": "coordinator event time"},
        {"metric": "PS failover: 1 s window rate >= 90% of the rate before", "gossamer": fmt(f_rec),
         "restart-from-checkpoint baseline": f"{base_ps:.2f} s", "baseline / gossamer": ratio(base_ps, f_rec),
         "note": f"same worker count before and after; worst gap between increments {fmt(f_gap)}"},
        {"metric": "stop-the-world restart: cancel -> first step of a resubmitted job",
         "gossamer": "not needed", "restart-from-checkpoint baseline": fmt(restart),
         "baseline / gossamer": "",
         "note": f"MEASURED: cancel + resubmit on the same idle agents (all role processes respawn, model rebuilt, "
                 f"backup synced); identical-spec runs only: {fmt(restart_same)}; two start-ups in a row: submit -> "
                 f"'running' (shard processes up, backup synced) {fmt(to_running)}, then workers start -> first "
                 f"step {fmt(run_first)}. gossamer cannot resume a cancelled job: the baseline rows are MODELLED "
                 "from this and the measured step rate"},
        {"metric": "step rate, 3 workers + 1 shard (+ backup)", "gossamer": fmt(rate_full, "versions/s", 0),
         "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": "primary shard version rate in the 3 s before each kill"},
        {"metric": f"checkpoint overhead: step rate, checkpoint_every={CKPT_EVERY} vs 0",
         "gossamer": fmt(ovh, "%", 1), "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": f"target <= 3.5 %: {'met' if ovh and ovh['median'] <= 3.5 else 'NOT met'} by the median"
                 + (", but the pairwise spread is wider than the target: run-to-run noise on this machine hides an "
                    "effect of that size (see the two rows below for direct measures)"
                    if ovh and ovh["max"] - ovh["min"] > 3.5 else "") + "; alternating runs "
                 f"(on {', '.join(f'{x:.0f}' for x in on)} / off {', '.join(f'{x:.0f}' for x in off)} versions/s), "
                 "pairwise 1 - on/off; covers all checkpoint work of the job (shard snapshots, background DCP "
                 "saves, registration with the coordinator, disk writes) competing for 2 CPUs"},
        {"metric": "checkpoint: primary's ckpt_snapshot_s / wall time", "gossamer": fmt(snap, "%", 2),
         "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": f"target <= 3.5 % ({'met' if snap and snap['median'] <= 3.5 else 'NOT met'}); the snapshot copy "
                 "on the shard's serving thread, the only checkpoint work ON its training path; it does not "
                 "capture the next row"},
        {"metric": "checkpoint: primary's background save thread busy share of wall time",
         "gossamer": fmt(busy, "%", 1), "restart-from-checkpoint baseline": "", "baseline / gossamer": "",
         "note": f"saves/s x ckpt_write_s ({fmt(per_save, 'ms', 0)} per save: DCP files, sha256, fsyncs). This "
                 "thread shares the shard process's GIL (and here 2 CPUs) with the serving thread, so it slows "
                 "the shard, the throughput bottleneck: an upper bound on what the save can take from serving"},
    ]
    notes = (
        "Local cluster on loopback (coordinator + node agents + role processes), heartbeat 0.5 s, lease 5 s. "
        "digits MLP, async, lr 0.05, momentum 0.5, batch 32, 1 PS shard + backup, 3 spot workers (max_workers 3), "
        f"eval_every 0, checkpoint_every {CKPT_EVERY} in the main run. Figures: median (min–max, n). "
        "Baseline = torchrun-elastic style: on any failure stop everyone, restart from the last checkpoint; "
        "its restart cost is measured (cancel + resubmit of the same experiment until its first step), the "
        "steps redone are (version mod checkpoint_every) / measured rate; the two are summed, not observed "
        "together. " + ("--quick run (fewer repetitions). " if quick else "")
        + f"All processes on {os.cpu_count()} CPUs: workers and shards compete for cores, so rates are CPU-bound "
        f"and start-ups slow; 1-min load average during the run {min(loads, default=0):.1f}–{max(loads, default=0):.1f} "
        "(anything else running on the machine inflates start-up times and makes rates noisy)."
    )
    js, md = write_report("recovery", rows, notes, label="quick" if quick else None)
    data = json.loads(js.read_text())
    data["raw"] = raw
    data["summary"] = {
        "detect_s": detect, "recover_s": recover, "worst_gap_s": gap, "join_from_add_s": j_add,
        "join_from_join_event_s": j_join, "join_from_assign_event_s": j_assign,
        "join_from_role_start_s": j_role, "join_from_ready_event_s": j_ready,
        "failover_backup_advances_s": f_adv, "failover_promote_event_s": f_prom, "failover_recover_s": f_rec,
        "restart_s": restart, "restart_identical_s": restart_same, "redo_s": redo, "rate_versions_per_s": rate_full,
        "ckpt_overhead_pct": ovh, "ckpt_snapshot_pct": snap,
        "baseline_worker_failure_s": base_worker, "baseline_join_s": base_join, "baseline_ps_failure_s": base_ps,
        "quick": quick, "log_dir": str(log_dir),
    }
    tmp = js.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, js)
    print(md.read_text())
    print(f"wrote {js} and {md}; node logs in {log_dir}")


if __name__ == "__main__":
    main()
