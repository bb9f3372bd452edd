"""Simulated nodes for bench/coordinator_load.py: the real node protocol over gRPC, many nodes per asyncio process.

Each simulated node does what `gossamer worker join` does on the control plane (gossamer/worker/agent.py):
Join, one WatchAssignments stream, a heartbeat every `heartbeat_interval_s` (re-joining when the
coordinator answers `known=False`), ReportRole SERVING for each role it is given (a shard primary says its
backup is attached) and, for workers, a metric point every `metrics_every_s`. No role process runs.

Heartbeats are the unary gRPC Heartbeat, or with `udp` the UDP beat (gossamer/beat_wire.py) to the port and
key Join gave, all of a loader's nodes on one socket; a beat unanswered within three intervals is counted
(`udp_timeouts`) and followed by a gRPC Heartbeat, which also re-keys the node (a restarted coordinator).
"""

from __future__ import annotations

import asyncio
import multiprocessing.synchronize
import random
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from gossamer.beat_wire import Signer, peek_reply
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

NODES_PER_CHANNEL = 250  # HTTP/2 connections to the coordinator: one per this many simulated nodes


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """One loader process: nodes `first`..`first + count - 1`, plus `churn_per_min` joins and leaves."""

    address: str
    first: int
    count: int
    heartbeat_interval_s: float = 1.0
    joins_per_s: float = 400.0
    metrics_every_s: float = 5.0
    churn_per_min: float = 0.0
    churn_life_s: float = 20.0
    zones: int = 4
    udp: bool = False  # heartbeat with UDP beats instead of the unary gRPC call


@dataclass
class _Sim:
    """One simulated node: its id (it changes when it joins again) and UDP beat key."""

    i: int
    id: str = ""
    signer: Signer | None = None
    port: int = 0

    def keyed(self, resp: pb.JoinResponse | pb.HeartbeatResponse) -> None:
        if resp.beat_port:
            self.signer, self.port = Signer(resp.beat_key), resp.beat_port


@dataclass
class LoaderStats:
    """What one loader saw; latencies only between the parent's `measure` and `stop` events."""

    latencies_ms: list[float] = field(default_factory=list)
    sent: int = 0
    unknown: int = 0  # heartbeats answered known=False: the coordinator had declared the node lost
    errors: dict[str, int] = field(default_factory=dict)
    joined: int = 0
    churn_joined: int = 0
    churn_left: int = 0
    roles: int = 0
    metric_reports: int = 0
    udp_timeouts: int = 0  # UDP beats unanswered within three intervals (a gRPC heartbeat followed)
    node_ids: list[str] = field(default_factory=list)


class _BeatSocket(asyncio.DatagramProtocol):
    """The loader's one UDP socket: replies go back to `Loader.udp_reply`."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.loader.udp_reply(data)


class Loader:
    """The nodes of one process, their channels, and the counts the parent reads back."""

    def __init__(self, cfg: LoaderConfig, measure: multiprocessing.synchronize.Event,
                 stop: multiprocessing.synchronize.Event) -> None:
        self.cfg = cfg
        self.measure_ev, self.stop_ev = measure, stop
        self.measuring = False
        self.stopping = False
        self.stats = LoaderStats()
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[pb_grpc.NodeServiceStub] = []
        self.estubs: list[pb_grpc.ExperimentServiceStub] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.udp: asyncio.DatagramTransport | None = None
        self.counter = 0  # one count for all of this loader's nodes: each node's beats still increase
        self.pending: dict[int, tuple[float, _Sim, bool]] = {}  # counter -> (sent, node, measured)

    def _stub(self, i: int) -> tuple[pb_grpc.NodeServiceStub, pb_grpc.ExperimentServiceStub]:
        k = (i // NODES_PER_CHANNEL) % len(self.stubs)
        return self.stubs[k], self.estubs[k]

    def _error(self, e: grpc.RpcError) -> None:
        if self.stopping:  # the loader's own teardown cancels every call: not the coordinator's doing
            return
        name = f"{e.code().name} ({(e.details() or '')[:40]})" if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__
        self.stats.errors[name] = self.stats.errors.get(name, 0) + 1

    async def run(self) -> LoaderStats:
        n_channels = max(1, -(-(self.cfg.count + 50) // NODES_PER_CHANNEL))
        for _ in range(n_channels):
            # Each channel its own subchannel pool, so each is its own TCP connection.
            ch = grpc.aio.insecure_channel(self.cfg.address, options=[("grpc.use_local_subchannel_pool", 1)])
            self.channels.append(ch)
            self.stubs.append(pb_grpc.NodeServiceStub(ch))
            self.estubs.append(pb_grpc.ExperimentServiceStub(ch))
        watcher = asyncio.create_task(self._watch_events())
        if self.cfg.udp:
            self.udp, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: _BeatSocket(self), local_addr=("127.0.0.1", 0))
            self._spawn(self._udp_timeouts())
        gap = 1.0 / self.cfg.joins_per_s
        for k in range(self.cfg.count):
            self._spawn(self._node(self.cfg.first + k, life_s=None))
            await asyncio.sleep(gap)
        if self.cfg.churn_per_min:
            self._spawn(self._churn())
        while not self.stopping:
            await asyncio.sleep(0.1)
        watcher.cancel()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for ch in self.channels:
            await ch.close(None)
        if self.udp is not None:
            self.udp.close()
        return self.stats

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _watch_events(self) -> None:
        while True:
            self.measuring = self.measure_ev.is_set() and not self.stop_ev.is_set()
            if self.stop_ev.is_set():
                self.stopping = True
                return
            await asyncio.sleep(0.05)

    async def _join(self, sim: _Sim) -> None:
        i = sim.i
        stub, _ = self._stub(i)
        req = pb.JoinRequest(name=f"sim-{i}", address="127.0.0.1", hostname=f"simhost-{i}", cpus=1,
                             labels={"zone": f"z{i % self.cfg.zones}"}, node_id=sim.id, spot=i % 3 == 0)
        delay = 0.2
        while True:
            try:
                resp = await stub.Join(req, timeout=30.0)
                sim.id = resp.node_id
                sim.keyed(resp)
                return
            except grpc.aio.AioRpcError as e:
                self._error(e)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    async def _node(self, i: int, life_s: float | None) -> None:
        sim = _Sim(i)
        await self._join(sim)
        if life_s is None:
            self.stats.joined += 1
            self.stats.node_ids.append(sim.id)
        else:
            self.stats.churn_joined += 1
        watch = asyncio.create_task(self._watch(sim))
        try:
            await self._heartbeats(sim, life_s)
        finally:
            watch.cancel()
        if life_s is not None:
            stub, _ = self._stub(i)
            try:
                await stub.Leave(pb.LeaveRequest(node_id=sim.id, reason="churn"), timeout=30.0)
                self.stats.churn_left += 1
            except grpc.aio.AioRpcError as e:
                self._error(e)

    async def _heartbeats(self, sim: _Sim, life_s: float | None) -> None:
        interval = self.cfg.heartbeat_interval_s
        t_end = time.monotonic() + life_s if life_s is not None else float("inf")
        due = time.monotonic() + random.uniform(0, interval)  # noqa: S311 — spread the phases
        while time.monotonic() < t_end:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due += interval
            if self.udp is not None and sim.signer is not None:
                self.counter += 1
                self.pending[self.counter] = (time.perf_counter(), sim, self.measuring)
                self.udp.sendto(sim.signer.beat(sim.id, self.counter), ("127.0.0.1", sim.port))
                due = max(due, time.monotonic())
                continue  # the reply is timed by `udp_reply`
            await self._grpc_heartbeat(sim, measured=True)
            due = max(due, time.monotonic())  # a late answer: the next beat goes now, never in a burst

    async def _grpc_heartbeat(self, sim: _Sim, *, measured: bool) -> None:
        stub, _ = self._stub(sim.i)
        t0 = time.perf_counter()
        try:
            resp = await stub.Heartbeat(pb.HeartbeatRequest(node_id=sim.id), timeout=self.cfg.heartbeat_interval_s * 3)
        except grpc.aio.AioRpcError as e:
            self._error(e)
            return
        if self.measuring and measured:
            self.stats.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            self.stats.sent += 1
        sim.keyed(resp)
        if not resp.known:
            self.stats.unknown += 1
            await self._join(sim)

    def udp_reply(self, data: bytes) -> None:
        """A reply from the beat port: the beat it answers is timed; "unknown" makes the node join again."""
        counter = peek_reply(data)
        entry = self.pending.get(counter) if counter is not None else None
        if entry is None:
            return
        sent, sim, measured = entry
        got = sim.signer.check_reply(data) if sim.signer is not None else None
        if got is None:
            return
        del self.pending[got[0]]
        if measured and self.measuring:
            self.stats.latencies_ms.append((time.perf_counter() - sent) * 1e3)
            self.stats.sent += 1
        if not got[1]:
            self.stats.unknown += 1
            self._spawn(self._join(sim))

    async def _udp_timeouts(self) -> None:
        """Beats unanswered for three intervals: counted, and the node heartbeats over gRPC (a real node's fallback)."""
        limit = 3 * self.cfg.heartbeat_interval_s
        while True:
            await asyncio.sleep(0.5)
            now = time.perf_counter()
            late = [k for k, (sent, _, _) in self.pending.items() if now - sent > limit]
            for k in late:
                _, sim, _ = self.pending.pop(k)
                if not self.stopping:
                    self.stats.udp_timeouts += 1
                    self._spawn(self._grpc_heartbeat(sim, measured=False))

    async def _watch(self, sim: _Sim) -> None:
        i = sim.i
        stub, _ = self._stub(i)
        seen: set[tuple[str, int, int, int]] = set()
        metric_tasks: list[asyncio.Task[None]] = []
        try:
            while True:
                try:
                    async for aset in stub.WatchAssignments(pb.WatchAssignmentsRequest(node_id=sim.id)):
                        for a in aset.assignments:
                            key = (a.experiment_id, a.role, a.index, a.replica)
                            if key in seen:
                                continue
                            seen.add(key)
                            await self._serve(i, sim.id, a)
                            if a.role == pb.ROLE_WORKER:
                                metric_tasks.append(asyncio.create_task(self._metrics(i, sim.id, a)))
                except grpc.aio.AioRpcError as e:
                    self._error(e)
                await asyncio.sleep(0.5)
        finally:
            for t in metric_tasks:
                t.cancel()

    async def _serve(self, i: int, node_id: str, a: pb.Assignment) -> None:
        stub, _ = self._stub(i)
        ps = a.role == pb.ROLE_PARAMETER_SERVER
        req = pb.ReportRoleRequest(node_id=node_id, experiment_id=a.experiment_id, role=a.role, index=a.index,
                                   state=pb.ROLE_STATE_SERVING, endpoint=f"tcp://127.0.0.1:{20000 + i % 40000}",
                                   replica=a.replica, replicated=ps and a.replica == 0)
        try:
            await stub.ReportRole(req, timeout=30.0)
            self.stats.roles += 1
        except grpc.aio.AioRpcError as e:
            self._error(e)

    async def _metrics(self, i: int, node_id: str, a: pb.Assignment) -> None:
        _, estub = self._stub(i)
        step = 0
        while True:
            await asyncio.sleep(self.cfg.metrics_every_s)
            step += 10
            point = pb.MetricPoint(time_unix=time.time(), step=step, source=f"{node_id}/{a.index}",
                                   values={"loss": 1.0 / step, "step_rate": 2.0})
            try:
                resp = await estub.ReportMetrics(pb.ReportMetricsRequest(experiment_id=a.experiment_id,
                                                                         points=[point]), timeout=30.0)
                self.stats.metric_reports += 1
                if not resp.running:
                    return
            except grpc.aio.AioRpcError as e:
                self._error(e)

    async def _churn(self) -> None:
        """`churn_per_min` short-lived nodes a minute: each joins, heartbeats `churn_life_s`, leaves."""
        gap = 60.0 / self.cfg.churn_per_min
        k = 0
        while True:
            k += 1
            self._spawn(self._node(10_000_000 + self.cfg.first + k, life_s=self.cfg.churn_life_s))
            await asyncio.sleep(gap)


def loader_main(cfg: LoaderConfig, measure: multiprocessing.synchronize.Event,
                stop: multiprocessing.synchronize.Event, out: Any) -> None:
    """Process entry point: run the nodes until `stop`, then put the LoaderStats (as a dict) on `out`."""
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    stats = asyncio.run(Loader(cfg, measure, stop).run())
    out.put(stats.__dict__)
