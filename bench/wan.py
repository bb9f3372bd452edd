"""gossamer vs torch DDP (gloo) on an emulated slow network: four hosts in network namespaces.

    sudo .venv/bin/python -m bench.wan [--modes ddp,sync,async,gossip,diloco] [--rates 100mbit,1gbit]
                                       [--repeats 3] [--first-run K] [--straggler] [--append]
                                       [--quick] [--target 0.95] [--steps 160] [--log-dir DIR]
                                       [--set MODE.FIELD=VALUE ...] [--delay 10ms] [--shards 4]
    sudo .venv/bin/python -m bench.wan --merge-file LOG_DIR/runs.json   # a piece's runs into wan.json
    .venv/bin/python -m bench.wan --plot   # bench/out/wan.png (git-ignored) from bench/results/wan.json

Each (rate, mode) runs --repeats times (runs FIRST..FIRST+N-1, repeat by repeat so a load drift
spreads over the modes); the table shows per cell the median [min-max] over the completed runs
and ratios of medians to DDP; wan.json keeps every run. One repeat of the default (both rates,
five modes) takes about 17 minutes on a 2-core machine; --quick (40 steps) about 1 minute per run.
Run it in pieces: `--append` merges a piece's runs into the stored wan.json by (case, rate, mode,
run), replacing runs with the same key; each piece also saves its runs to LOG_DIR/runs.json after
every run, so a piece cut short can still be merged with --merge-file.

--straggler adds the straggler case: --straggler-modes (ddp,async,gossip) at --straggler-rate
(100mbit) with host --straggler-host (3) computing --slowdown (4) times slower: every host runs
the model `bench._straggler:mlp` (bench/_straggler.py, the same MLP), and that host's processes pad each
training forward and backward with a sleep of (F - 1) x its own measured time. Sleeping, not a
cgroup quota or a busy loop: on this shared 2-core machine those would take CPU from the other
three hosts or depend on what they get, while a padded host is F times slower than it would be
here at that moment and leaves the cores to the others, as a slower machine would.

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
  gossip  gossamer push-sum gossip (exponential graph), no servers; int8 CHOCO-style compressed
          differences (gossamer sends differences whenever gossip compresses) and `overlap` (the
          share goes out while the next step computes); gossip-fp32 (not in the default list) is
          the uncompressed, blocking gossip of earlier runs.
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

from bench._netns import Topology, cleanup_stale, parse_rate, require_netns_or_exit
from bench._report import RESULTS, plot_path, write_report
from bench._straggler import ENV as STRAGGLER_ENV
from bench._wan_stats import cell_of, fmt_cell, merge_runs, summarise

HERE = Path(__file__).resolve().parent

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
    # not in the default list: no staleness bound (ASP): a fast worker never waits for a slow one,
    # a stale push's lr is divided by its staleness (lr_staleness_scaling); for the straggler case
    "async-asp": {"mode": "async", "staleness": None, "compression": "topk:0.01", "pull_compression": "topk:0.01"},
    # not in the default list: SSP s=4 that waits for a straggler too (gossamer's bound before it left
    # stragglers out, `wait_for_stragglers`); for the straggler case
    "async-wait": {"mode": "async", "staleness": 4, "compression": "topk:0.01", "pull_compression": "topk:0.01",
                   "wait_for_stragglers": True},
    # not in the default list: top-k pushes, pulls as int8 differences (the workers train from closer
    # parameters than top-k 1 % differences leave them; 4x the pull bytes of fp32/4)
    "async-pull8": {"mode": "async", "staleness": 4, "compression": "topk:0.01", "pull_compression": "int8"},
    # not in the default list: int8 both ways, cheaper to encode than top-k and kinder to SGD
    "async-int8": {"mode": "async", "staleness": 4, "compression": "int8", "pull_compression": "int8"},
    # int8 CHOCO-style differences (gossamer sends differences whenever gossip compresses) and
    # the share exchanged while the next step computes
    "gossip": {"mode": "gossip", "topology": "exponential", "compression": "int8", "overlap": True},
    # not in the default list: the uncompressed, blocking gossip of earlier runs
    "gossip-fp32": {"mode": "gossip", "topology": "exponential"},
    "diloco": {"mode": "diloco", "inner_steps": 20, "outer_step": "sync"},
}
#: total_steps and eval_every of a mode per global DDP step: async counts one version per push.
STEP_SCALE = {"sync": 1, "async": WORKERS, "gossip": 1, "diloco": 1}  # by the spec's `mode`
MODE_LABEL = {
    "ddp": "torch DDP (gloo), SGD",
    "sync": "PS, BSP, fp32",
    "async": "PS, SSP s=4, top-k 1% push + pull",
    "async-int8": "PS, SSP s=4, int8 push + pull",
    "async-pull8": "PS, SSP s=4, top-k 1% push, int8 pull",
    "async-asp": "PS, ASP (no staleness bound), top-k 1% push + pull",
    "async-wait": "PS, SSP s=4 waiting for stragglers, top-k 1% push + pull",
    "gossip": "push-sum gossip, exponential graph, int8 differences (CHOCO), overlap",
    "gossip-fp32": "push-sum gossip, exponential graph, fp32, no overlap",
    "diloco": "DiLoCo H=20, SGD inner, sync outer Nesterov, int8 pseudo-grad",
}

#: The straggler case: the model that pads compute where $WAN_SLOWDOWN says (bench/_straggler.py).
STRAGGLER_MODEL = {"model": "bench._straggler:mlp"}

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
def run_ddp(net: Topology, run_dir: Path, steps: int, eval_every: int, timeout: float,
            slow: tuple[int, float] | None = None) -> dict[str, Any]:
    cfg = {**WORKLOAD, "total_steps": steps, "eval_every": eval_every, **(STRAGGLER_MODEL if slow else {})}
    log = run_dir / "ddp-rank0.jsonl"
    wire = WireSampler(net)
    t_launch = time.time()
    procs = []
    for h in net.hosts:
        procs.append(net.spawn(h.index, [
            PY, "-m", "bench._ddp_worker", "--rank", str(h.index), "--world", str(WORKERS),
            "--master", f"{net.hosts[0].addr}:{MASTER_PORT}", "--ifname", h.ifname,
            "--config", json.dumps(cfg), "--log", str(log), "--threads", "1",
        ], log=run_dir / f"ddp-rank{h.index}.log", env=_env(h.index, slow), cwd=str(HERE.parent)))
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
    if os.environ.get("WAN_VERSION"):  # a piece run from an exported snapshot of the tree (no .git)
        return os.environ["WAN_VERSION"]
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


def _env(host: int | None = None, slow: tuple[int, float] | None = None) -> dict[str, str]:
    """Environment of a process on `host`; with `slow` = (straggler host, factor), the repository on the path
    (the `bench._straggler` model) and, on the straggler host only, its slowdown."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop(STRAGGLER_ENV, None)
    if slow:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(HERE.parent)) if p)
        if host == slow[0]:
            env[STRAGGLER_ENV] = str(slow[1])
    return env


def _gossamer_cli() -> list[str]:
    return [PY, "-m", "gossamer.tools.cli"]


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
                 timeout: float, slow: tuple[int, float] | None = None) -> dict[str, Any]:
    env = _env(None, slow)
    if slow:
        spec = {**spec, **STRAGGLER_MODEL}
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
                                    log=run_dir / f"w{h.index}.log", env=_env(h.index, slow), cwd=str(run_dir)))
        result_file = run_dir / "follow.json"
        follower = net.spawn(0, [PY, "-m", "bench.wan", "_follow", "--coordinator", address,
                                 "--spec", json.dumps(spec), "--nodes", str(len(agents)), "--out", str(result_file),
                                 "--timeout", str(timeout)], log=run_dir / "follow.log", env=env, cwd=str(HERE.parent))
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
    from gossamer.core.errors import GossamerError
    from gossamer.core.experiment import Experiment

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


CELL_LABEL = {"normal": "", "straggler": " (straggler)"}


def build_rows(runs: list[dict[str, Any]], target: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Markdown rows, one per (case, rate, mode) cell: median [min-max] over its runs, ratios of medians
    to DDP's cell at the same (case, rate); and the numeric summary of every cell."""
    stats = summarise(runs)
    rows = []
    for (case, rate, mode), st in stats.items():
        cell_runs = [r for r in runs if cell_of(r) == (case, rate, mode)]
        statuses = sorted({r["status"] for r in cell_runs})
        status = f"{st['completed']}/{st['runs']} completed" + (
            "" if statuses == ["completed"] else " (" + ", ".join(statuses) + ")")
        tt = fmt_cell(st["tt_target_s"], st["tt_target_s_spread"])
        if st["completed"] and st["reached"] < st["completed"]:
            tt = (tt + " " if tt else "") + f"(reached in {st['reached']}/{st['completed']})"
        load = st["loadavg_spread"]
        rows.append({
            "case": case, "rate": rate, "mode": mode, "runs": status,
            "setup": " / ".join(sorted({str(r.get("setup", MODE_LABEL.get(mode, mode))) for r in cell_runs})),
            "samples/s": fmt_cell(st["samples_per_s"], st["samples_per_s_spread"], 0),
            f"time to acc {target:g} (s)": tt,
            "incl. startup (s)": fmt_cell(st["tt_target_e2e_s"], st["tt_target_e2e_s_spread"]),
            "final acc": fmt_cell(st["final_acc"], st["final_acc_spread"], 4),
            "best acc": fmt_cell(st["best_acc"], st["best_acc_spread"], 4),
            "wire MB": fmt_cell(st["wire_MB"], st["wire_MB_spread"], 0),
            "wire MB to target": fmt_cell(st["wire_MB_to_target"], st["wire_MB_to_target_spread"], 0),
            "speedup to target vs DDP": fmt_cell(st["speedup_to_target"], st["speedup_to_target_spread"], 2, "x"),
            "samples/s vs DDP": fmt_cell(st["samples_per_s_ratio"], None, 2, "x"),
            "bytes vs DDP": fmt_cell(st["bytes_ratio"], None, 3, "x"),
            "final acc - DDP (points)": fmt_cell(st["final_acc_delta_points"], None, 2),
            "loadavg": fmt_cell(load[0], load) if load else "",
            "version": ", ".join(sorted({str(r.get("version", "")) for r in cell_runs})),
        })
    summary: dict[str, Any] = {}
    for (case, rate, mode), st in stats.items():
        summary.setdefault(case, {}).setdefault(rate, {})[mode] = st
    return rows, summary


def targets(summary: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """The WAN targets from the cell medians: (what, met (None: not measured), figures)."""
    out: list[tuple[str, bool | None, str]] = []

    def speedup(case: str, mode: str, need: float) -> None:
        st = summary.get(case, {}).get("100mbit", {}).get(mode)
        what = f"{case} 100mbit: {mode} reaches the target >= {need:g}x faster than DDP (medians)"
        if not st or st.get("speedup_to_target") is None:
            out.append((what, None, "not measured" if not st else "no time to target on one side"))
            return
        sp, rng = st["speedup_to_target"], st["speedup_to_target_spread"]
        out.append((what, sp >= need and st["all_reached"],
                    f"{fmt_cell(sp, rng, 2, 'x')}, reached in {st['reached']}/{st['completed']} runs"))

    speedup("normal", "gossip", 2.0)
    for mode in ("async", "async-pull8"):
        st = summary.get("normal", {}).get("100mbit", {}).get(mode)
        what = f"normal 100mbit: {mode} (top-k push) final accuracy within 1 point of DDP's (medians)"
        if st and st.get("final_acc_delta_points") is not None:
            d = st["final_acc_delta_points"]
            out.append((what, d >= -1.0, f"{d:+.2f} points ({mode} {fmt_cell(st['final_acc'], st['final_acc_spread'], 4)})"))
        elif mode == "async":
            out.append((what, None, "not measured"))
    speedup("straggler", "async", 2.0)
    if "async-asp" in summary.get("straggler", {}).get("100mbit", {}):
        speedup("straggler", "async-asp", 2.0)
    speedup("straggler", "gossip", 2.0)
    return out


def plot(runs: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    panels = list(dict.fromkeys((r.get("case", "normal"), r["rate"]) for r in runs))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    colors: dict[str, Any] = {}
    for ax, (case, rate) in zip(axes[0], panels, strict=True):
        seen: set[str] = set()
        for run in runs:
            if (run.get("case", "normal"), run["rate"]) != (case, rate) or not run.get("evals") or not run.get("t0"):
                continue
            mode = run["mode"]
            color = colors.setdefault(mode, f"C{len(colors)}")
            t = [e[0] - run["t0"] for e in run["evals"]]
            ax.plot(t, [e[2] for e in run["evals"]], marker=".", lw=0.9, ms=3, color=color,
                    label=None if mode in seen else mode)
            seen.add(mode)
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{rate} per host link, 4 hosts{CELL_LABEL.get(case, ' (' + case + ')')}; every run")
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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="ddp,sync,async,gossip,diloco", help="'' or none: no normal-case runs")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (case, rate, mode), interleaved")
    ap.add_argument("--first-run", type=int, default=0, help="index of the first repeat (runs FIRST..FIRST+N-1)")
    ap.add_argument("--straggler", action="store_true", help="also run the straggler case (see the module doc)")
    ap.add_argument("--straggler-modes", default="ddp,async,gossip")
    ap.add_argument("--straggler-rate", default="100mbit")
    ap.add_argument("--slowdown", type=float, default=4.0, help="compute factor of the straggler host")
    ap.add_argument("--straggler-host", type=int, default=WORKERS - 1, help="host index of the straggler")
    ap.add_argument("--append", action="store_true",
                    help="merge into bench/results/wan.json: a run with the same (case, rate, mode, run) replaces "
                         "the stored one, the others stay")
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
    ap.add_argument("--replot", action="store_true",
                    help="only rewrite wan.md (and draw bench/out/wan.png) from bench/results/wan.json")
    ap.add_argument("--plot", action="store_true", help="run nothing: draw bench/out/wan.png from bench/results/wan.json")
    ap.add_argument("--merge-file", default=None, metavar="RUNS_JSON",
                    help="run nothing: merge the runs a piece saved (LOG_DIR/runs.json) into bench/results/wan.json")
    return ap.parse_args()


def plan(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """(case, rate, mode, run) in running order: repeat by repeat, so load drifts spread over the modes."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "none"]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    slow_modes = [m.strip() for m in args.straggler_modes.split(",") if m.strip()] if args.straggler else []
    for r in [*rates, args.straggler_rate]:
        parse_rate(r)
    unknown = [m for m in [*modes, *slow_modes] if m != "ddp" and m not in MODE_SPECS]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from ddp, {', '.join(MODE_SPECS)}")
    out = []
    for k in range(args.first_run, args.first_run + args.repeats):
        out += [("normal", rate, mode, k) for rate in rates for mode in modes]
        out += [("straggler", args.straggler_rate, mode, k) for mode in slow_modes]
    return out


def run_all(args: argparse.Namespace, todo: list[tuple[str, str, str, int]], steps: int, eval_every: int,
            log_dir: Path, save: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every run of `todo` in one topology; `save(runs, net_info)` after each (a killed piece keeps its runs)."""
    overrides = parse_overrides(args.set)
    shards = max(1, min(args.shards, WORKERS))
    version = _git_version()
    runs: list[dict[str, Any]] = []
    with Topology(WORKERS, rate=todo[0][1], delay=args.delay) as net:
        net_info: dict[str, Any] = {"prefix": net.prefix, "hosts": [h.addr for h in net.hosts], "netem": net.netem,
                                    "delay": args.delay, "latency": net.latency}
        say(f"namespaces {net.switch} + {[h.ns for h in net.hosts]}; netem "
            f"{'not asked for' if net.netem is None else ('used' if net.netem else 'NOT available: no delay added')}")
        for i, (case, rate, mode, k) in enumerate(todo):
            if net.rate != rate:
                net.set_rate(rate)
            net_info.setdefault("qdiscs", {})[rate] = net.qdiscs()
            net_info.setdefault("burst", {})[rate] = net.burst_for(rate)
            slow = (args.straggler_host, args.slowdown) if case == "straggler" else None
            run_dir = log_dir / f"{case}-{rate}-{mode}-{k}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a stale port file or state must not be reused
            run_dir.mkdir(parents=True)
            say(f"[{i + 1}/{len(todo)}] {case} {rate} {mode} run {k}: starting")
            t_run = time.monotonic()
            load0 = _loadavg()
            if mode == "ddp":
                run = run_ddp(net, run_dir, steps, eval_every, args.run_timeout, slow)
            else:
                spec = gossamer_spec(mode, steps, eval_every, overrides)
                run = run_gossamer(net, mode, run_dir, spec, shards, args.run_timeout, slow)
            run.update(case=case, rate=rate, run=k, version=version, setup=MODE_LABEL.get(mode, mode), run_wall_s=time.monotonic() - t_run,
                       loadavg=[load0, _loadavg()], time_start_unix=run["t_launch"], steps=steps,
                       eval_every=eval_every, log_dir=str(run_dir))
            if slow:
                run["straggler"] = {"host": slow[0], "node": f"w{slow[0]}", "slowdown": slow[1],
                                    "emulation": "bench/_straggler.py: padded training forward/backward"}
            run["fig"] = figures(run, args.target) if run["status"] not in ("not available", "refused") else {}
            fig = run["fig"]
            say(f"{case} {rate} {mode} run {k}: {run['status']} {run.get('message', '')[:200]} | "
                f"{fig.get('samples_per_s', float('nan')):.0f} samples/s, target in "
                f"{fig.get('tt_target_s', float('nan')):.1f} s, final acc {fig.get('final_acc', float('nan')):.4f}, "
                f"wire {fig.get('wire_MB', float('nan')):.1f} MB ({run['run_wall_s']:.0f} s wall, "
                f"load {run['loadavg'][0]:.1f}-{run['loadavg'][1]:.1f})")
            # The raw metric series and status polls stay in each run's follow.json under the log dir.
            runs.append({k2: v for k2, v in run.items() if not k2.startswith("_") and k2 not in ("metrics", "polls")})
            save(runs, net_info)
    return runs, net_info


def notes_for(data: dict[str, Any], summary: dict[str, Any]) -> tuple[str, list[tuple[str, bool | None, str]]]:
    """The report's notes (targets first) from the stored bench data."""
    goals = targets(summary)
    verdicts = "; ".join(f"{'MET' if ok else ('NOT MEASURED' if ok is None else 'MISSED')}: {what}: {figs}"
                         for what, ok, figs in goals)
    net_info, runs = data.get("network", {}), data["runs"]
    steps, eval_every = data["steps"], data["eval_every"]
    bursts = ", ".join(f"{b} at {r}" for r, b in net_info.get("burst", {}).items())
    loads = [x for r in runs for x in r.get("loadavg", [])]
    reps = sorted({int(r.get("run", 0)) for r in runs})
    versions = sorted({str(r.get("version", "")) for r in runs})
    slow = next((r["straggler"] for r in runs if r.get("straggler")), None)
    netem_txt = ("netem delay " + str(net_info.get("delay")) + " per direction under the tbf" if net_info.get("netem")
                 else "no added latency (on this machine's kernel netem is absent)")
    notes = (
        f"**Targets** (from the medians below): {verdicts}. "
        f"Each (case, rate, mode) cell ran {len(reps)} time(s) (runs {', '.join(map(str, reps))}), repeat by repeat "
        f"so that load drifts spread over the modes; cells show median [min-max] over the completed runs; ratios vs "
        f"DDP are ratios of the medians (the speedup's range divides DDP's median by the cell's slowest and fastest "
        f"run); every run's figures are in wan.json `runs`. "
        + (f"Straggler case: host {slow['host']} ({slow['node']}, and DDP rank {slow['host']}) computes "
           f"{slow['slowdown']:g}x slower: its training forward and backward are padded with a sleep of "
           f"{slow['slowdown'] - 1:g}x their own measured time (bench/_straggler.py; every host of the case runs the "
           f"same model code, only that host's process has WAN_SLOWDOWN set): the host is slower without taking CPU "
           f"from the other three, which a cgroup quota or a busy loop would on this shared 2-core machine; "
           f"evaluation and the optimizer step are not padded. async (SSP, staleness 4) holds a worker more than 4 "
           f"clocks ahead of the slowest, so its three fast workers go at the straggler's pace (each pushed about "
           f"a quarter of the updates); async-asp lifts the bound (a stale push's lr divided by its staleness). "
           if slow else "")
        + f"Four hosts = four Linux network namespaces on one bridge (in a fifth namespace), addresses "
        f"{', '.join(net_info.get('hosts', []))}/24. Each host link shaped with tc tbf on both ends of its veth "
        f"(host egress and switch-port egress): rate as in the table, burst {bursts}, latency "
        f"{net_info.get('latency')} (queue limit, not delay); {netem_txt}. "
        f"Workload: digits MLP 64-1024-1024-10 (1.13 M params, 4.5 MB fp32), per-worker batch 32, SGD lr 0.05 "
        f"momentum 0.9, {steps} global steps of 4 x 32 samples for every mode (async: {steps * WORKERS} pushes of "
        f"32), eval on the 360 held-out digits every {eval_every} global steps by rank 0 / gossamer's lead worker. "
        f"Target eval accuracy {data['target']:g}. DDP: gloo, one rank per host, the same global batches as gossamer "
        f"sync. gossamer: a fresh cluster per run (coordinator on h0; per host an on-demand node agent for the "
        f"shards and a spot node agent that trains), ps_backup off, checkpoint_every 0, `--threads 1`. "
        f"Times: training time starts at DDP's post-rendezvous barrier and at gossamer's FIRST worker 'ready' event "
        f"(so waiting for slower workers counts against gossamer); 'incl. startup' starts at process launch. "
        f"Evaluation is part of the measured time: DDP rank 0 and gossamer's lead evaluate the 360 eval digits; "
        f"gossip's lead gathers the other workers' parameters for it on a thread beside its training, all three "
        f"asked at once (off the training path, as fp16 since 2026-11-28, but the 3 x 2.3 MB still cross its link: on "
        f"100 Mbit/s one evaluation takes a second or more and the next is asked for at the first eval_every step after it, so "
        f"gossip's evaluations are sparser than DDP's and its time to target is that of a later step); diloco evaluates once per round (20 steps). "
        f"samples/s = samples trained / training time. Wire bytes = sum over the 4 hosts of their veth tx counters "
        f"from launch to exit (payload + TCP/IP/Ethernet headers, control plane included); 'to target' is the "
        f"interpolated counter between training start and the first eval at/above the target. Caveats: "
        f"{os.cpu_count()} CPU cores shared by all 4 hosts (plus shard servers, node agents and the coordinator), so "
        f"a mode's samples/s is bounded by CPU, not only the link; the machine is shared with other work: 1-min "
        f"load average at the start/end of the runs {min(loads, default=0):.1f}-{max(loads, default=0):.1f} (per "
        f"cell in the table); tbf emulates a bandwidth cap, not WAN latency or loss; accuracy on 360 eval samples "
        f"moves in steps of 0.28 points. gossamer at {', '.join(versions)}."
    )
    return notes, goals


def write(data: dict[str, Any]) -> None:
    """wan.json (every run), wan.md (a row per cell) and bench/out/wan.png from `data` (bench data with `runs`)."""
    rows, summary = build_rows(data["runs"], data["target"])
    notes, goals = notes_for(data, summary)
    js, md = write_report("wan", rows, notes)
    stored = json.loads(js.read_text())
    stored.update({k: v for k, v in data.items() if k not in stored}, summary=_keyed(summary),
                  targets=[{"target": w, "met": ok, "figures": f} for w, ok, f in goals])
    tmp = js.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(stored, indent=1, default=str) + "\n")
    os.replace(tmp, js)
    png = plot_path("wan")
    plot(data["runs"], data["target"], png)
    print(md.read_text())
    say(f"wrote {js}, {md} and {png}")
    for what, ok, figs in goals:
        say(f"{'MET' if ok else ('NOT MEASURED' if ok is None else 'MISSED')}: {what}: {figs}")


def _check_same_workload(old: dict[str, Any], steps: int, eval_every: int, target: float) -> None:
    if old and (old.get("steps"), old.get("eval_every"), old.get("target")) != (steps, eval_every, target):
        raise SystemExit(f"cannot merge: stored steps/eval_every/target {old.get('steps')}/{old.get('eval_every')}/"
                         f"{old.get('target')}, this piece {steps}/{eval_every}/{target}")


def _merged(old: dict[str, Any], piece: dict[str, Any]) -> dict[str, Any]:
    """Bench data of `old` (stored wan.json; may be empty) with a piece's runs merged in by key."""
    _check_same_workload(old, piece["steps"], piece["eval_every"], piece["target"])
    network = {**old.get("network", {}), **piece["network"]}
    for key in ("qdiscs", "burst"):
        network[key] = {**old.get("network", {}).get(key, {}), **piece["network"].get(key, {})}
    return {**piece, "network": network, "pieces": [*old.get("pieces", []), *piece["pieces"]],
            "runs": merge_runs(old.get("runs", []), piece["runs"])}


def _keyed(summary: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe summary (tuples as lists)."""
    return json.loads(json.dumps(summary, default=list))


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

    args = parse_args()
    stored_path = RESULTS / "wan.json"
    if args.plot:
        stored = json.loads(stored_path.read_text())
        plot(stored["runs"], stored["target"], plot_path("wan"))
        return 0
    if args.replot:
        write(json.loads(stored_path.read_text()))
        return 0
    if args.merge_file:
        piece = json.loads(Path(args.merge_file).read_text())
        old = json.loads(stored_path.read_text()) if stored_path.exists() else {}
        write(_merged(old, piece))
        return 0
    todo = plan(args)
    if not todo:
        raise SystemExit("nothing to run (no modes and no --straggler)")
    require_netns_or_exit("bench/wan.py")
    stale = cleanup_stale()
    if stale:
        say(f"removed namespaces left by earlier runs that were killed: {stale}")
    steps = args.steps or (40 if args.quick else 160)
    eval_every = args.eval_every or (5 if args.quick else 10)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gsm-wan-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"logs under {log_dir}; {len(todo)} runs: {todo}; {steps} global steps, eval every {eval_every}, "
        f"target {args.target}")
    old: dict[str, Any] = {}
    if args.append and stored_path.exists():
        old = json.loads(stored_path.read_text())
        _check_same_workload(old, steps, eval_every, args.target)
    t_bench = time.monotonic()

    def piece_of(runs: list[dict[str, Any]], net_info: dict[str, Any]) -> dict[str, Any]:
        return {"network": net_info, "workload": WORKLOAD, "mode_specs": MODE_SPECS,
                "overrides": parse_overrides(args.set), "steps": steps, "eval_every": eval_every,
                "target": args.target, "quick": args.quick, "runs": runs,
                "pieces": [{"argv": sys.argv[1:], "bench_s": time.monotonic() - t_bench, "log_dir": str(log_dir),
                            "time_unix": time.time(), "runs": len(runs)}]}

    def save(runs: list[dict[str, Any]], net_info: dict[str, Any]) -> None:
        # after every run: a piece that is killed keeps what it measured (`--merge-file` merges it)
        tmp = log_dir / "runs.json.tmp"
        tmp.write_text(json.dumps(piece_of(runs, net_info), default=str))
        os.replace(tmp, log_dir / "runs.json")

    runs, net_info = run_all(args, todo, steps, eval_every, log_dir, save)
    bench_s = time.monotonic() - t_bench
    say(f"{len(runs)} runs took {bench_s / 60:.1f} min; runs in {log_dir / 'runs.json'}")
    if args.no_write:
        for row in build_rows(runs, args.target)[0]:
            print(row)
        return 0
    piece = piece_of(runs, net_info)
    data = _merged(old, piece)
    write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
