"""gossamer vs torch DDP (gloo) on an emulated slow network: four hosts in network namespaces.

    sudo .venv/bin/python bench/wan.py [--modes ddp,sync,async,gossip,diloco] [--rates 100mbit,1gbit]
                                       [--quick] [--target 0.95] [--steps 160] [--log-dir DIR]
                                       [--set MODE.FIELD=VALUE ...] [--delay 10ms] [--shards 4]

The default (both rates, five modes) takes about 14 minutes on a 2-core machine; --quick
(40 steps) about 1 minute per run.

Needs root (network namespaces, veth, tc); without it, it says so and exits with code 2.

Network (bench/_netns.py): a "switch" namespace holding a bridge, four host namespaces each with
a veth to it (10.77.0.1-4/24). Every host link is shaped with `tc ... tbf` on both ends of its
veth (the host's egress and the switch port's egress, i.e. the host's ingress) at each rate of
--rates. Latency is added with netem only where the kernel has it (--delay); the result notes
say whether it was.

Workload: scikit-learn digits (`gossamer.examples.digits:data`), an MLP 64-1024-1024-10
(1.13 M parameters, 4.5 MB in fp32), per-worker batch 32, SGD lr 0.05 momentum 0.9, seed 0; four
workers, one per host, `--threads 1` each (the four hosts share this machine's cores).

Runs, one after the other in the same invocation, per rate:
  ddp     torch DDP over gloo, one rank per host namespace (bench/_ddp_worker.py), TCP store on
          host 0; the same global batches as gossamer's sync mode (gossamer's sampler), SGD.
  sync    gossamer BSP through parameter servers.
  async   gossamer SSP (staleness 4, lr/tau), top-k 1 % both ways (`compression` and
          `pull_compression` = "topk:0.01", error feedback).
  gossip  gossamer push-sum gossip (exponential graph), no servers.
  diloco  gossamer DiLoCo: 20 inner steps (SGD, as everywhere here; gossamer's default would be
          AdamW), int8 pseudo-gradients (its default), outer Nesterov step on the shards, synchronous.
Every gossamer run gets a fresh cluster: the coordinator in host 0, on each host one on-demand
node agent (the coordinator places the parameter-server shards on on-demand nodes: one shard
per host with the default --shards 4) and one spot node agent (the coordinator trains on spot
nodes first), `--threads 1`, all as real processes run with `ip netns exec`. A mode the
coordinator refuses ("not available in this release") is recorded as such and the bench goes on.

Samples are the same in every mode: S global steps of 4 x 32 (DDP, sync; --steps, default 160),
4 S updates of 32 (async: a shard version is one worker's push), S steps per worker (gossip),
S inner steps per worker (diloco: S/20 rounds; an S that is not a multiple of 20 is rounded up
by gossamer, so keep it one).

Measured per (rate, mode): samples/s over the training time, time to the target eval accuracy
(from the first worker ready / DDP's post-rendezvous barrier; and from launch), final and best
eval accuracy, bytes on the wire (tx bytes of the four hosts' veths, read from the kernel's
counters in each namespace: real bytes with TCP/IP headers, control plane included), all as
ratios to DDP at the same rate. Writes bench/results/wan.{json,md,png}; process logs stay under
--log-dir (printed at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _netns import Topology, cleanup_stale, parse_rate, require_netns_or_exit  # noqa: E402
from _report import RESULTS, write_report  # noqa: E402

PY = sys.executable
WORKERS = 4
MASTER_PORT = 29500

WORKLOAD: dict[str, Any] = {
    "model": "gossamer.examples.digits:mlp", "model_args": {"hidden": 1024, "depth": 2},
    "dataset": "gossamer.examples.digits:data", "batch_size": 32, "optimizer": "sgd", "lr": 0.05,
    "momentum": 0.9, "seed": 0,
}

#: Experiment fields of each gossamer mode on top of WORKLOAD (see the module doc); `--set
#: MODE.FIELD=VALUE` overrides any of them from the command line.
MODE_SPECS: dict[str, dict[str, Any]] = {
    "sync": {"mode": "sync"},
    "async": {"mode": "async", "staleness": 4, "compression": "topk:0.01", "pull_compression": "topk:0.01"},
    # not in the default list: int8 both ways, cheaper to encode than top-k and kinder to SGD
    "async-int8": {"mode": "async", "staleness": 4, "compression": "int8", "pull_compression": "int8"},
    "gossip": {"mode": "gossip", "topology": "exponential"},
    "diloco": {"mode": "diloco", "inner_steps": 20, "outer_step": "sync"},
}
#: total_steps and eval_every of a mode per global DDP step: async counts one version per push.
STEP_SCALE = {"sync": 1, "async": WORKERS, "gossip": 1, "diloco": 1}  # by the spec's `mode`
MODE_LABEL = {
    "ddp": "torch DDP (gloo), SGD",
    "sync": "PS, BSP, fp32",
    "async": "PS, SSP s=4, top-k 1% push + pull",
    "async-int8": "PS, SSP s=4, int8 push + pull",
    "gossip": "push-sum gossip, exponential graph, fp32",
    "diloco": "DiLoCo H=20, SGD inner, sync outer Nesterov, int8 pseudo-grad",
}

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Counters of the four host links, sampled in the background
# ------------------------------------------------------------------------------------------
class WireSampler(threading.Thread):
    """Samples the hosts' veth counters every `period` s: [(time_unix, total tx bytes)]."""

    def __init__(self, net: Topology, period: float = 1.0) -> None:
        super().__init__(daemon=True, name="wire-sampler")
        self.net, self.period = net, period
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()
        self.first = net.counters()
        self.samples.append((time.time(), 0))
        self.start()

    def _total(self, c: dict[int, dict[str, int]]) -> int:
        return sum(c[i]["tx_bytes"] - self.first[i]["tx_bytes"] for i in c)

    def run(self) -> None:
        while not self._halt.wait(self.period):
            try:
                self.samples.append((time.time(), self._total(self.net.counters())))
            except Exception:  # noqa: BLE001 — a sample missed is not fatal
                pass

    def stop(self) -> dict[int, dict[str, int]]:
        self._halt.set()
        self.join(timeout=5)
        last = self.net.counters()
        self.samples.append((time.time(), self._total(last)))
        return Topology.delta(self.first, last)

    def bytes_at(self, t: float) -> float:
        """Total tx bytes since the start, linearly interpolated at time t."""
        s = self.samples
        if t <= s[0][0]:
            return 0.0
        for (t1, b1), (t2, b2) in zip(s, s[1:], strict=False):
            if t1 <= t <= t2:
                return b1 + (b2 - b1) * (t - t1) / max(1e-9, t2 - t1)
        return float(s[-1][1])


# ------------------------------------------------------------------------------------------
# DDP baseline
# ------------------------------------------------------------------------------------------
def run_ddp(net: Topology, run_dir: Path, steps: int, eval_every: int, timeout: float) -> dict[str, Any]:
    cfg = {**WORKLOAD, "total_steps": steps, "eval_every": eval_every}
    log = run_dir / "ddp-rank0.jsonl"
    env = _env()
    wire = WireSampler(net)
    t_launch = time.time()
    procs = []
    for h in net.hosts:
        procs.append(net.spawn(h.index, [
            PY, str(HERE / "_ddp_worker.py"), "--rank", str(h.index), "--world", str(WORKERS),
            "--master", f"{net.hosts[0].addr}:{MASTER_PORT}", "--ifname", h.ifname,
            "--config", json.dumps(cfg), "--log", str(log), "--threads", "1",
        ], log=run_dir / f"ddp-rank{h.index}.log", env=env, cwd=str(HERE.parent)))
    deadline = time.monotonic() + timeout
    status, message = "completed", ""
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            status, message = "timeout", f"not finished within {timeout:.0f} s"
            break
        if any(p.poll() not in (None, 0) for p in procs):
            status = "failed"
            bad = next(p for p in procs if p.poll() not in (None, 0))
            message = f"rank {procs.index(bad)} exited with {bad.returncode}; see {run_dir}/ddp-rank*.log"
            break
        time.sleep(0.2)
    Topology.stop_all(procs, timeout=5)
    net.reap()
    if status == "completed" and any(p.returncode != 0 for p in procs):
        status, message = "failed", f"exit codes {[p.returncode for p in procs]}"
    wire_delta = wire.stop()
    recs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    start = next((r for r in recs if r["event"] == "start"), None)
    end = next((r for r in recs if r["event"] == "end"), None)
    evals = [(r["time_unix"], r["step"], r["eval_accuracy"], r["eval_loss"]) for r in recs if r["event"] == "eval"]
    out: dict[str, Any] = {
        "mode": "ddp", "status": status, "message": message, "t_launch": t_launch,
        "t0": start["time_unix"] if start else None, "evals": evals, "wire": wire_delta,
        "wire_series": wire.samples, "placement": "one gloo rank per host; TCP store on h0",
    }
    if start and end:
        out["samples"] = end["samples"]
        out["t_end"] = end["time_unix"]
    out["_wire"] = wire
    return out


# ------------------------------------------------------------------------------------------
# gossamer: a fresh cluster per run, the client inside host 0's namespace
# ------------------------------------------------------------------------------------------
def _git_version() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE.parent, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gossamer"], capture_output=True, text=True,
                               cwd=HERE.parent, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head + (" + uncommitted changes under gossamer/" if dirty else "")


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _gossamer_cli() -> list[str]:
    return [PY, "-m", "gossamer.cli"]


def gossamer_spec(mode: str, steps: int, eval_every: int, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = {**MODE_SPECS.get(mode, {"mode": mode}), **overrides.get(mode, {})}
    scale = STEP_SCALE.get(base["mode"], 1)
    spec = {
        **WORKLOAD, "name": f"wan-{mode}", "total_steps": steps * scale, "eval_every": eval_every * scale,
        "min_workers": WORKERS, "max_workers": WORKERS, "ps_backup": False, "checkpoint_every": 0,
        **MODE_SPECS.get(mode, {"mode": mode}),
    }
    spec.update(overrides.get(mode, {}))
    return spec


def run_gossamer(net: Topology, mode: str, run_dir: Path, spec: dict[str, Any], shards: int,
                 timeout: float) -> dict[str, Any]:
    env = _env()
    state = run_dir / "state"
    state.mkdir(parents=True, exist_ok=True)
    ready = run_dir / "coordinator.port"
    ready.unlink(missing_ok=True)
    h0 = net.hosts[0]
    spec = {**spec, "num_ps_shards": shards}
    wire = WireSampler(net)
    t_launch = time.time()
    coord = net.spawn(0, [*_gossamer_cli(), "coordinator", "serve", "--host", h0.addr, "--port", "0",
                          "--state-dir", str(state), "--ready-file", str(ready), "--heartbeat-interval", "1",
                          "--lease-timeout", "10", "--no-import-check"], log=run_dir / "coordinator.log", env=env, cwd=str(run_dir))
    out: dict[str, Any] = {"mode": mode, "t_launch": t_launch, "spec": spec}
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coordinator did not start; see {run_dir / 'coordinator.log'}")
            time.sleep(0.05)
        address = f"{h0.addr}:{int(ready.read_text())}"
        agents = []
        # On-demand nodes host the shards (one per host, first `shards` hosts), spot nodes train.
        for h in net.hosts[:shards]:
            agents.append(net.spawn(h.index, [*_gossamer_cli(), "worker", "join", address, "--name", f"ps{h.index}",
                                              "--address", h.addr, "--threads", "1", "--grace", "5"],
                                    log=run_dir / f"ps{h.index}.log", env=env, cwd=str(run_dir)))
        for h in net.hosts:
            agents.append(net.spawn(h.index, [*_gossamer_cli(), "worker", "join", address, "--name", f"w{h.index}",
                                              "--address", h.addr, "--threads", "1", "--spot", "--grace", "5"],
                                    log=run_dir / f"w{h.index}.log", env=env, cwd=str(run_dir)))
        result_file = run_dir / "follow.json"
        follower = net.spawn(0, [PY, str(Path(__file__).resolve()), "_follow", "--coordinator", address,
                                 "--spec", json.dumps(spec), "--nodes", str(len(agents)), "--out", str(result_file),
                                 "--timeout", str(timeout)], log=run_dir / "follow.log", env=env, cwd=str(run_dir))
        try:
            follower.wait(timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            Topology.stop(follower)
        if result_file.exists():
            out.update(json.loads(result_file.read_text()))
        else:
            out.update(status="failed", message=f"the follower wrote nothing; see {run_dir / 'follow.log'}")
    except Exception as e:  # noqa: BLE001 — one run failing must not end the bench
        out.update(status="failed", message=f"{type(e).__name__}: {e}")
    finally:
        Topology.stop_all(net.procs, timeout=10)
        net.reap()
    out["wire"] = wire.stop()
    out["wire_series"] = wire.samples
    out["_wire"] = wire
    _digest_gossamer(out)
    return out


def _digest_gossamer(out: dict[str, Any]) -> None:
    """From the follower's raw metrics and events: eval series, t0, samples, placement."""
    points = out.get("metrics") or []
    events = out.get("events") or []
    final = out.get("final_status") or {}
    evals = sorted((p["time_unix"], p.get("eval_step", p["step"]), p["eval_accuracy"], p.get("eval_loss", math.nan))
                   for p in points if "eval_accuracy" in p)
    out["evals"] = evals
    ready = [e["time_unix"] for e in events if e["kind"] == "ready"]
    out["t0"] = min(ready) if ready else (final.get("started_unix") or None)
    out["t0_all_ready"] = max(ready) if ready else None
    latest: dict[str, tuple[float, float]] = {}
    for p in points:
        if "samples" in p and "/ps" not in p["source"]:
            latest[p["source"]] = max(latest.get(p["source"], (0.0, 0.0)), (p["time_unix"], p["samples"]))
    if latest:
        out["samples"] = sum(v for _, v in latest.values())
        out["t_end"] = max(t for t, _ in latest.values())
    roles = final.get("roles") or []
    ps = sorted(f"shard {r['index']} on {r['node']}" for r in roles if r["role"] == "ps")
    workers = sorted(r["node"] for r in roles if r["role"] == "worker")
    out["placement"] = ("; ".join(ps) + ("; " if ps else "no servers; ") + "workers " + ", ".join(workers)) \
        if roles else ""
    sched = next((e["message"] for e in events if e["kind"] == "schedule"), None)
    if sched:
        out["placement"] = sched


def follow(args: argparse.Namespace) -> int:
    """Inside host 0's namespace: wait for the nodes, submit, poll until finished, dump everything."""
    import dataclasses

    from gossamer import Client
    from gossamer.errors import GossamerError
    from gossamer.experiment import Experiment

    spec = json.loads(args.spec)
    known = {f.name for f in dataclasses.fields(Experiment)}
    dropped = sorted(set(spec) - known)
    spec = {k: v for k, v in spec.items() if k in known}
    out: dict[str, Any] = {"dropped_fields": dropped, "polls": []}

    def dump() -> None:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(out, default=str))
        os.replace(tmp, args.out)

    client = Client(args.coordinator, timeout=30)
    try:
        client.ping(timeout=60)
        deadline = time.monotonic() + 90
        while sum(n["state"] == "ready" for n in client.nodes()) < args.nodes:
            if time.monotonic() > deadline:
                out.update(status="failed", message=f"only {len(client.nodes())} of {args.nodes} nodes joined")
                dump()
                return 1
            time.sleep(0.2)
        out["t_submit"] = time.time()
        try:
            job = client.submit(spec)
        except GossamerError as e:
            msg = str(e)
            out.update(status="not available" if "not available" in msg else "refused", message=msg)
            dump()
            return 0
        out["id"] = job.id
        deadline = time.monotonic() + args.timeout
        last_steps, last_change = -1, time.monotonic()
        st: dict[str, Any] = {}
        while True:
            st = job.status()
            m = st["metrics"]
            out["polls"].append({"time_unix": time.time(), "state": st["state"], "steps": st["steps"],
                                 **{k: m[k] for k in ("eval_accuracy", "samples", "loss") if k in m}})
            if st["state"] in ("completed", "failed", "cancelled"):
                out.update(status=st["state"], message=st["message"])
                break
            if st["steps"] != last_steps:
                last_steps, last_change = st["steps"], time.monotonic()
            if time.monotonic() > deadline or time.monotonic() - last_change > args.stall:
                why = "timeout" if time.monotonic() > deadline else "stalled"
                out.update(status=why, message=f"{why} at step {st['steps']}/{st['total_steps']} ({st['state']}: "
                                               f"{st['message']})")
                job.cancel()
                break
            time.sleep(0.5)
        out["final_status"] = job.status()
        out["metrics"] = job.metrics()
        out["events"] = job.events()
    except Exception as e:  # noqa: BLE001
        out.setdefault("status", "failed")
        out["message"] = f"{out.get('message', '')} follower: {type(e).__name__}: {e}".strip()
    finally:
        dump()
        client.close()
    return 0


# ------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------
def figures(run: dict[str, Any], target: float) -> dict[str, Any]:
    """Samples/s, time to target, accuracies and wire bytes of one finished run."""
    t0, t_launch = run.get("t0"), run["t_launch"]
    evals = run.get("evals") or []
    wire = run["_wire"]
    f: dict[str, Any] = {}
    total_tx = sum(v["tx_bytes"] for v in run["wire"].values())
    f["wire_MB"] = total_tx / 1e6
    f["startup_s"] = (t0 - t_launch) if t0 else None
    if t0 and run.get("t_end") and run.get("samples"):
        f["train_s"] = run["t_end"] - t0
        f["samples"] = run["samples"]
        f["samples_per_s"] = run["samples"] / max(1e-9, run["t_end"] - t0)
        f["wire_B_per_sample"] = total_tx / run["samples"]
        f["wire_MB_train"] = (wire.bytes_at(run["t_end"]) - wire.bytes_at(t0)) / 1e6
    if evals:
        f["final_acc"] = evals[-1][2]
        f["final_loss"] = evals[-1][3]
        f["best_acc"] = max(e[2] for e in evals)
    hit = next((e for e in evals if e[2] >= target), None)
    f["reached"] = hit is not None
    if hit and t0:
        f["tt_target_s"] = hit[0] - t0
        f["tt_target_e2e_s"] = hit[0] - t_launch
        f["step_at_target"] = hit[1]
        f["wire_MB_to_target"] = (wire.bytes_at(hit[0]) - wire.bytes_at(t0)) / 1e6
    return f


def _f(x: Any, d: int = 1, suffix: str = "") -> str:
    """A table cell: fixed decimals, '' for a missing or NaN figure."""
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or x != x:
        return ""
    return f"{x:.{d}f}{suffix}"


def build_rows(runs: list[dict[str, Any]], target: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Markdown rows (formatted strings) and a numeric summary per rate (ratios vs DDP included)."""
    rows = []
    summary: dict[str, Any] = {}
    by_rate: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_rate.setdefault(run["rate"], {})[run["mode"]] = run
    for rate, modes in by_rate.items():
        ddp = modes.get("ddp")
        dfig = ddp["fig"] if ddp and ddp["status"] == "completed" else {}
        met = []
        per_mode: dict[str, Any] = {}
        for mode, run in modes.items():
            fig = run.get("fig", {})
            ratios: dict[str, float | None] = {"speedup_to_target": None, "samples_per_s_ratio": None,
                                               "bytes_ratio": None, "final_acc_delta_points": None}
            if dfig:
                if fig.get("tt_target_s") and dfig.get("tt_target_s"):
                    ratios["speedup_to_target"] = dfig["tt_target_s"] / fig["tt_target_s"]
                if fig.get("samples_per_s") and dfig.get("samples_per_s"):
                    ratios["samples_per_s_ratio"] = fig["samples_per_s"] / dfig["samples_per_s"]
                if fig.get("wire_MB") and dfig.get("wire_MB"):
                    ratios["bytes_ratio"] = fig["wire_MB"] / dfig["wire_MB"]
                if fig.get("final_acc") is not None and dfig.get("final_acc") is not None:
                    ratios["final_acc_delta_points"] = 100 * (fig["final_acc"] - dfig["final_acc"])
            status = run["status"]
            if run.get("message") and status != "completed":
                status = f"{status}: {run['message'][:160]}"
            rows.append({
                "rate": rate, "mode": mode, "setup": MODE_LABEL.get(mode, mode), "status": status,
                "samples/s": _f(fig.get("samples_per_s"), 0),
                f"time to acc {target:g} (s)": _f(fig.get("tt_target_s")) or ("not reached" if fig else ""),
                "incl. startup (s)": _f(fig.get("tt_target_e2e_s")),
                "final acc": _f(fig.get("final_acc"), 4), "best acc": _f(fig.get("best_acc"), 4),
                "wire MB": _f(fig.get("wire_MB"), 0), "wire MB to target": _f(fig.get("wire_MB_to_target"), 0),
                "speedup to target vs DDP": _f(ratios["speedup_to_target"], 2, "x"),
                "samples/s vs DDP": _f(ratios["samples_per_s_ratio"], 2, "x"),
                "bytes vs DDP": _f(ratios["bytes_ratio"], 3, "x"),
                "final acc - DDP (points)": _f(ratios["final_acc_delta_points"], 2),
                "placement": run.get("placement", ""),
            })
            per_mode[mode] = {"status": run["status"], **{k: v for k, v in fig.items()}, **ratios}
            sp, da = ratios["speedup_to_target"], ratios["final_acc_delta_points"]
            if mode != "ddp" and sp is not None and sp >= 5 and da is not None and da >= -1:
                met.append(f"{mode} ({sp:.1f}x, {da:+.1f} points)")
        summary[rate] = {"ddp_time_to_target_s": dfig.get("tt_target_s"), "modes_meeting_5x_1pt": met,
                         "modes": per_mode}
    return rows, summary


def plot(runs: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rates = list(dict.fromkeys(r["rate"] for r in runs))
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.6), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for run in runs:
            if run["rate"] != rate or not run.get("evals") or not run.get("t0"):
                continue
            t = [e[0] - run["t0"] for e in run["evals"]]
            ax.plot(t, [e[2] for e in run["evals"]], marker=".", label=run["mode"])
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{rate} per host link (tbf, both directions), 4 hosts")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("wall time since training start (s, log scale)")
        ax.set_ylabel("eval accuracy (digits, 360 held out)")
        ax.set_ylim(0.3, 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        mode, dot, field = key.partition(".")
        if not sep or not dot:
            raise SystemExit(f"--set expects MODE.FIELD=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(mode, {})[field] = value
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_follow":
        ap = argparse.ArgumentParser()
        ap.add_argument("_follow")
        ap.add_argument("--coordinator", required=True)
        ap.add_argument("--spec", required=True)
        ap.add_argument("--nodes", type=int, required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--timeout", type=float, default=600)
        ap.add_argument("--stall", type=float, default=120)
        return follow(ap.parse_args())

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="ddp,sync,async,gossip,diloco")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--quick", action="store_true", help="short smoke run (few steps)")
    ap.add_argument("--steps", type=int, default=None, help="global (DDP) steps of 4 x 32 samples (default 160)")
    ap.add_argument("--eval-every", type=int, default=None, help="in global steps (default 10)")
    ap.add_argument("--target", type=float, default=0.95, help="target eval accuracy")
    ap.add_argument("--shards", type=int, default=WORKERS, help="parameter-server shards, one per host")
    ap.add_argument("--delay", default=None, help="one-way netem delay per link direction, e.g. 10ms "
                                                  "(only if the kernel has netem)")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds per run before it is cancelled")
    ap.add_argument("--set", action="append", default=[], metavar="MODE.FIELD=VALUE",
                    help="override an experiment field of one gossamer mode, e.g. diloco.inner_steps=10")
    ap.add_argument("--log-dir", default=None, help="process logs, one subdirectory per run (replaced if it "
                                                    "exists); default a new temporary directory")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/results/wan.*")
    ap.add_argument("--replot", action="store_true", help="only redraw wan.png from bench/results/wan.json")
    args = ap.parse_args()
    if args.replot:
        data = json.loads((RESULTS / "wan.json").read_text())
        plot(data["runs"], data["target"], RESULTS / "wan.png")
        return 0

    require_netns_or_exit("bench/wan.py")
    stale = cleanup_stale()
    if stale:
        say(f"removed namespaces left by earlier runs that were killed: {stale}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for r in rates:
        parse_rate(r)
    unknown = [m for m in modes if m != "ddp" and m not in MODE_SPECS]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from ddp, {', '.join(MODE_SPECS)}")
    steps = args.steps or (40 if args.quick else 160)
    eval_every = args.eval_every or (5 if args.quick else 10)
    overrides = parse_overrides(args.set)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gsm-wan-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shards = max(1, min(args.shards, WORKERS))
    say(f"logs under {log_dir}; modes {modes}, rates {rates}, {steps} global steps, eval every {eval_every}, "
        f"target {args.target}")

    version = _git_version()
    bursts = ""
    runs: list[dict[str, Any]] = []
    net_info: dict[str, Any] = {}
    t_bench = time.monotonic()
    with Topology(WORKERS, rate=rates[0], delay=args.delay) as net:
        net_info = {"prefix": net.prefix, "hosts": [h.addr for h in net.hosts], "netem": net.netem,
                    "delay": args.delay, "latency": net.latency}
        say(f"namespaces {net.switch} + {[h.ns for h in net.hosts]}; netem "
            f"{'not asked for' if net.netem is None else ('used' if net.netem else 'NOT available: no delay added')}")
        for rate in rates:
            net.set_rate(rate)
            net_info.setdefault("qdiscs", {})[rate] = net.qdiscs()
            net_info.setdefault("burst", {})[rate] = net.burst_for(rate)
            for mode in modes:
                run_dir = log_dir / f"{rate}-{mode}"
                shutil.rmtree(run_dir, ignore_errors=True)  # a stale port file or state must not be reused
                run_dir.mkdir(parents=True)
                say(f"{rate} {mode}: starting")
                t_run = time.monotonic()
                load0 = _loadavg()
                if mode == "ddp":
                    run = run_ddp(net, run_dir, steps, eval_every, args.run_timeout)
                else:
                    spec = gossamer_spec(mode, steps, eval_every, overrides)
                    run = run_gossamer(net, mode, run_dir, spec, shards, args.run_timeout)
                run["rate"] = rate
                run["run_wall_s"] = time.monotonic() - t_run
                run["loadavg"] = [load0, _loadavg()]
                run["fig"] = figures(run, args.target) if run["status"] not in ("not available", "refused") else {}
                fig = run["fig"]
                say(f"{rate} {mode}: {run['status']} {run.get('message', '')[:200]} | "
                    f"{fig.get('samples_per_s', float('nan')):.0f} samples/s, target in "
                    f"{fig.get('tt_target_s', float('nan')):.1f} s, final acc {fig.get('final_acc', float('nan')):.4f}, "
                    f"wire {fig.get('wire_MB', float('nan')):.1f} MB ({run['run_wall_s']:.0f} s wall)")
                runs.append(run)
    bench_s = time.monotonic() - t_bench

    rows, summary = build_rows(runs, args.target)
    bursts = ", ".join(f"{b} at {r}" for r, b in net_info.get("burst", {}).items())
    loads = [x for r in runs for x in r.get("loadavg", [])]
    met_rate = "100mbit" if "100mbit" in summary else rates[0]
    met = summary.get(met_rate, {}).get("modes_meeting_5x_1pt", [])
    verdict = (f"target met at {met_rate}: {', '.join(met)} reach(es) eval accuracy {args.target:g} >= 5x faster than "
               "DDP with final accuracy at most 1 point lower" if met else
               f"target NOT met at {met_rate}: no gossamer mode run here reaches eval accuracy {args.target:g} >= 5x "
               "faster than DDP with final accuracy at most 1 point lower")
    netem_txt = ("netem delay " + str(args.delay) + " per direction under the tbf" if net_info.get("netem") else
                 ("no added latency: netem is not in this kernel (`tc qdisc add ... netem` -> 'Specified qdisc kind is "
                  "unknown')" if args.delay else
                  "no added latency (netem not requested; on this machine's kernel netem is absent anyway)"))
    notes = (
        f"**{verdict}.** "
        f"Four hosts = four Linux network namespaces on one bridge (in a fifth namespace), addresses "
        f"{', '.join(net_info.get('hosts', []))}/24. Each host link shaped with tc tbf on both ends of its veth (host egress "
        f"and switch-port egress): rate as in the table, burst {bursts}, latency {net_info.get('latency')} "
        f"(queue limit, not delay); {netem_txt}. "
        f"Workload: digits MLP 64-1024-1024-10 (1.13 M params, 4.5 MB fp32), per-worker batch 32, SGD lr 0.05 momentum 0.9, "
        f"{steps} global steps of 4 x 32 samples for every mode (async: {steps * WORKERS} pushes of 32), eval on the 360 "
        f"held-out digits every {eval_every} global steps by rank 0 / gossamer's lead worker. Target eval accuracy "
        f"{args.target:g}. DDP: gloo, one rank per host, the same global batches as gossamer sync. gossamer: a fresh "
        f"cluster per run (coordinator on h0; per host an on-demand node agent for the shards, {shards} shard(s), and a "
        f"spot node agent that trains), ps_backup off (no replication traffic), checkpoint_every 0, `--threads 1`. "
        f"Times: training time starts at DDP's post-rendezvous barrier and at gossamer's FIRST worker 'ready' event "
        f"(so waiting for slower workers counts against gossamer); 'incl. startup' starts at process launch. "
        f"Evaluation is part of the measured time: DDP rank 0 and gossamer's lead evaluate the 360 eval digits; gossip's "
        f"lead first gathers the other workers' parameters (push-sum average, 3 x 4.5 MB into its link), so gossip's "
        f"time and bytes include that cost; diloco evaluates once per round (20 steps). "
        f"samples/s = samples trained / training time. Wire bytes = sum over the 4 hosts of their veth tx counters "
        f"(kernel, in each namespace) from launch to exit: payload + TCP/IP/Ethernet headers, control plane (gRPC "
        f"heartbeats, metrics, rendezvous) included; 'to target' is the interpolated counter between training start "
        f"and the first eval at/above the target. Caveats: this machine has {os.cpu_count()} CPU cores shared by all 4 "
        f"hosts (plus shard servers, node agents and the coordinator), so compute contention is real and a mode's "
        f"samples/s is bounded by CPU, not only the link; tbf emulates a bandwidth cap, not WAN latency or loss; one "
        f"run per (rate, mode), no repetitions; accuracy on 360 eval samples moves in steps of 0.28 points; "
        f"1-min load average at the start/end of the runs {min(loads, default=0):.1f}-{max(loads, default=0):.1f} "
        f"(anything else running on the machine takes CPU from the emulated hosts: the runs are not isolated). "
        f"gossamer at {version}. Whole bench: {bench_s / 60:.1f} min." + (" --quick smoke run." if args.quick else "")
    )
    # The raw metric series and status polls stay in each run's follow.json under the log dir.
    clean_runs = [{k: v for k, v in r.items() if not k.startswith("_") and k not in ("metrics", "polls")}
                  for r in runs]
    if not args.no_write:
        js, md = write_report("wan", rows, notes)
        data = json.loads(js.read_text())
        data.update(summary=summary, verdict=verdict, network=net_info, workload=WORKLOAD, mode_specs=MODE_SPECS,
                    overrides=overrides, steps=steps, eval_every=eval_every, target=args.target, bench_s=bench_s,
                    quick=args.quick, log_dir=str(log_dir), runs=clean_runs)
        tmp = js.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        os.replace(tmp, js)
        plot(runs, args.target, RESULTS / "wan.png")
        print(md.read_text())
        say(f"wrote {js}, {md} and {RESULTS / 'wan.png'}; logs in {log_dir}")
    else:
        for row in rows:
            print(row)
    say(verdict)
    say(f"bench took {bench_s / 60:.1f} min")
    if shutil.which("ip") and net_info.get("prefix"):
        from _netns import list_namespaces

        left = [n for n in list_namespaces() if n.startswith(net_info["prefix"])]
        if left:
            say(f"WARNING: namespaces left behind: {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
