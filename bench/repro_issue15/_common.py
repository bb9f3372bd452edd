"""Shared pieces of the issue-15 reproductions: a real local cluster, a stranger's ZMQ socket, a process's memory.

Everything here works with whichever `gossamer` is first on PYTHONPATH (912ec8e or newer): the
cluster goes through `gossamer.local_cluster.LocalCluster` and `gossamer.client.Client`, both
present in every version, and the data plane is spoken by hand (msgpack header, raw tensor
frames; wire v1 is the same in both trees).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

WIRE_VERSION = 1
#: Every flood stops once the server has grown by this much: it already proves the failure.
FLOOD_LIMIT_BYTES = 1 << 30
LOG_ROOT = Path(os.environ.get("REPRO_LOG_ROOT", "/tmp/repro_issue15"))


@dataclass
class Outcome:
    """One reproduction's verdict: passed (the hardening holds), the figure it measured, and details."""

    name: str
    passed: bool | None  # None: not run (says why in `figure`)
    figure: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "result": verdict(self.passed), "figure": self.figure, "details": self.details}


def verdict(passed: bool | None) -> str:
    return "SKIP" if passed is None else ("PASS" if passed else "FAIL")


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> Any:
    """Poll `pred` until truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


# -- memory of a process ----------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return 0


def pid_listening_on(port: int) -> int:
    """The pid of the process holding the TCP socket listening on `port` (one of ours)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(parts[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        cwd = os.readlink(proc / "cwd")
                        if (Path(cwd) / "gossamer").exists():
                            raise RuntimeError(f"pid {proc.name} runs in {cwd}, which holds a gossamer package: "
                                               "it may not be the tree under test")
                        return int(proc.name)
    raise LookupError(f"no process of ours listens on port {port}")


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


# -- a stranger on the data plane -------------------------------------------------------------
def frames(op: str, experiment: str, shard: int, sender: str, meta: dict[str, Any],
           tensors: dict[str, np.ndarray] | None = None, version: int = 0) -> list[bytes]:
    """A data-plane message built by hand: msgpack header + one raw frame per tensor."""
    specs, payload = [], []
    for name, arr in (tensors or {}).items():
        arr = np.ascontiguousarray(arr)
        specs.append({"name": name, "dtype": str(arr.dtype), "shape": list(arr.shape)})
        payload.append(arr.tobytes())
    header = {"v": WIRE_VERSION, "op": op, "experiment": experiment, "shard": shard, "version": version,
              "sender": sender, "tensors": specs, "meta": meta}
    return [msgpack.packb(header, use_bin_type=True), *payload]


def read_header(reply: list[bytes]) -> dict[str, Any]:
    return msgpack.unpackb(reply[0], raw=False)


class Stranger:
    """Plain ZMQ DEALER sockets of someone who was never assigned anything."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []

    def socket(self, endpoint: str, *, reads: bool = True) -> zmq.Socket:
        """A DEALER connected to `endpoint`; `reads` False: it buffers at most one reply itself,
        so what it does not read stays queued on the server."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if not reads:
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(endpoint)
        self.socks.append(s)
        return s

    def ask(self, endpoint: str, msg: list[bytes], timeout: float = 15.0) -> tuple[dict[str, Any], list[bytes]]:
        """Send one request on a fresh socket and wait for its reply (header, tensor frames)."""
        s = self.socket(endpoint)
        try:
            s.send_multipart(msg)
            if not s.poll(int(timeout * 1000)):
                raise TimeoutError(f"no reply from {endpoint} within {timeout:.0f}s")
            reply = s.recv_multipart()
            return read_header(reply), reply[1:]
        finally:
            s.close(linger=0)
            self.socks.remove(s)

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.socks.clear()
        self.ctx.term()


def stats(stranger: Stranger, endpoint: str, experiment: str, shard: int = 0) -> dict[str, Any]:
    """A shard's STATS (any peer may ask, in every version)."""
    head, _ = stranger.ask(endpoint, frames("STATS", experiment, shard, "observer", {"rid": 1}))
    if head["op"] != "STATS":
        raise RuntimeError(f"STATS refused: {head['meta']}")
    return head["meta"]


def chunk_layout(model_args: dict[str, Any], num_shards: int, shard: int, chunk_numel: int) -> dict[int, int]:
    """Chunk index -> numel of `shard`, as anyone who knows the public model can compute it."""
    from gossamer.examples.digits import mlp
    from gossamer.paramserver import ShardPlan

    plan = ShardPlan.for_module(mlp(**model_args), num_shards, chunk_numel=chunk_numel)
    return {c.index: c.numel for c in plan.chunks_of_shard(shard)}


# -- a real cluster -----------------------------------------------------------------------------
def digits_experiment(name: str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": name, "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "num_ps_shards": 1, "ps_backup": False, "min_workers": 1, "max_workers": 1,
        "total_steps": 1_000_000, "eval_every": 0,
    }
    base.update(over)
    return base


class Cluster:
    """A `LocalCluster` (coordinator + named nodes) and its client; closes every process it started."""

    def __init__(self, name: str, label: str) -> None:
        from gossamer.local_cluster import LocalCluster

        self.log_dir = LOG_ROOT / label / name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="repro15-")
        self.lc = LocalCluster(self._tmp.name, log_dir=self.log_dir, heartbeat_interval=0.5, lease_timeout=5.0)
        self.lc.start_coordinator(port=0)
        self.client = self.lc.client()

    def add_nodes(self, on_demand: list[str], spot: list[str] = ()) -> None:  # type: ignore[assignment]
        for n in on_demand:
            self.lc.add_node(n)
        # The shard goes to an on-demand node: let those join first.
        self.wait_nodes(len(on_demand))
        for n in spot:
            self.lc.add_node(n, spot=True)
        self.wait_nodes(len(on_demand) + len(spot))

    def wait_nodes(self, count: int, timeout: float = 120.0) -> None:
        wait_for(lambda: sum(n["state"] in ("ready", "busy") for n in self.client.nodes()) >= count, timeout,
                 f"{count} nodes to join")

    def submit(self, exp: dict[str, Any]) -> Any:
        return self.client.submit(exp)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.lc.close()
        self._tmp.cleanup()


def ps_roles(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Serving shard replicas by replica number (0 primary, 1 backup) for shard 0."""
    return {r["replica"]: r for r in status["roles"] if r["role"] == "ps" and r["index"] == 0 and r["endpoint"]}


def wait_running(job: Any, steps: int, timeout: float = 240.0, replicas: int = 1) -> dict[str, Any]:
    """Wait until the experiment has `steps` steps and `replicas` shard replicas with endpoints."""
    def ready() -> dict[str, Any] | None:
        st = job.status()
        if st["state"] in ("failed", "cancelled", "completed"):
            raise RuntimeError(f"experiment ended early: {st['state']} {st['message']}")
        return st if st["steps"] >= steps and len(ps_roles(st)) >= replicas else None

    return wait_for(ready, timeout, f"{steps} steps and {replicas} shard replica(s)", every=0.5)


def dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def cluster(name: str, label: str) -> Iterator[Cluster]:
    c = Cluster(name, label)
    try:
        yield c
    finally:
        c.close()


def flood(stranger: Stranger, pid: int, endpoint: str, make_msg: Callable[[int], list[bytes]], total: int,
          sockets: int, *, limit: int = FLOOD_LIMIT_BYTES, settle_s: float = 12.0) -> dict[str, Any]:
    """Send `total` requests over `sockets` DEALERs that never read; watch the server's RSS.

    Stops as soon as the server grew past `limit` (the failure is proven; the machine is shared).
    Returns what was sent and the largest growth seen, sampled until `settle_s` after the last send.
    """
    base = rss_bytes(pid)
    socks = [stranger.socket(endpoint, reads=False) for _ in range(sockets)]
    t0 = time.monotonic()
    sent = 0
    peak = 0
    hit = False
    for i in range(total):
        try:
            socks[i % sockets].send_multipart(make_msg(i), zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
        if i % 10 == 9:
            peak = max(peak, rss_bytes(pid) - base)
            if peak > limit:
                hit = True
                break
            time.sleep(0.01)  # give the server a chance to answer what it got
    last = time.monotonic()
    # A loaded server may take seconds to reach the requests: watch for the whole settle time.
    while not hit and time.monotonic() - last < settle_s:
        peak = max(peak, rss_bytes(pid) - base)
        hit = peak > limit
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close(linger=0)
        stranger.socks.remove(s)
    return {"sent": sent, "growth_bytes": peak, "seconds": round(elapsed, 1), "stopped_at_limit": hit,
            "base_rss_bytes": base}


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def main(name: str, fn: Callable[[str], Outcome]) -> None:
    """A reproduction script's entry point: `--label L --json OUT`; prints and writes its outcome."""
    import argparse
    import traceback

    p = argparse.ArgumentParser()
    p.add_argument("--label", default="manual")
    p.add_argument("--json", default="")
    args = p.parse_args()
    # `python -m gossamer.cli` (every node LocalCluster starts) puts its working directory first on
    # sys.path: run from an empty one, so the nodes import the same gossamer as this process.
    json_path = Path(args.json).resolve() if args.json else None
    empty = tempfile.mkdtemp(prefix="repro15-cwd-")
    os.chdir(empty)
    import gossamer

    try:
        out = fn(args.label).to_json()
        out["details"]["gossamer"] = gossamer.__file__
    except Exception as e:  # noqa: BLE001 - reported as ERROR with its traceback
        out = {"name": name, "result": "ERROR", "figure": f"{type(e).__name__}: {e}",
               "details": {"traceback": traceback.format_exc()[-3000:]}}
    print(json.dumps(out, indent=2, default=str))
    if json_path is not None:
        json_path.write_text(json.dumps(out, default=str))
    os.rmdir(empty)
