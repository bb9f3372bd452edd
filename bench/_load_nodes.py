"""Simulated nodes for bench/coordinator_load.py: the real node protocol over gRPC and UDP, many nodes per asyncio process.

Each simulated node does what `gossamer worker join` does on the control plane (gossamer/node/agent.py):
Join (timeout 5 s, retried after 0.5 s doubling to 5 s on any error, as `NodeAgent._join`), one
WatchAssignments stream, a heartbeat every `heartbeat_interval_s` (joining again when the coordinator
answers `known=False`), ReportRole SERVING for each role it is given (a shard primary says its backup is
attached) and, for workers, a metric point every `metrics_every_s`. No role process runs.

Heartbeats follow the real node's rules (node/heartbeat.py, node/beat_sender.py), per node:

* at most one gRPC Heartbeat in flight (the real node's heartbeat thread waits for its answer, deadline
  3 intervals); a tick that comes due meanwhile goes once it is answered, never in a burst;
* with `udp`, a tick sends one UDP beat (transport/beat_wire.py) to the port and key Join gave, and a gRPC Heartbeat
  as well while no beat under this key has been answered yet, or after `HEDGE_MISSES` ticks in a row
  without any reply (one, for a lease under `HEDGE_MISSES + 2` intervals), such hedges at most one a
  third of the lease, the gap doubling (up to the lease) after a hedge answered late or not at all;
* after `MISSES_TO_PAUSE` such ticks, gRPC having answered promptly meanwhile, gRPC alone for
  `PAUSE_BEATS` intervals;
* a reply saying the node is not known: gRPC at once (whose `known=False` makes it join again).

Joins arrive paced (`joins_per_s` for this loader), like machines booting, not all at once. The nodes'
ticks are kept in one heap per loader and a loader's beats go out on one UDP socket, so a simulated node
costs the loader a few tens of microseconds a second: the loaders share the cores the coordinator is not
pinned to, and their own scheduling delay is in every latency they measure.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import multiprocessing.synchronize
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from gossamer.node.beat_sender import HEDGE_MISSES, MISSES_TO_PAUSE, PAUSE_BEATS, PENDING
from gossamer.node.leave import deliver_leave
from gossamer.transport.beat_wire import Signer, peek_reply
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

NODES_PER_CHANNEL = 250  # HTTP/2 connections to the coordinator: one per this many simulated nodes
LEAVE_BUDGET_S = 25.0  # NodeAgent's default grace (30 s) less the 5 s it keeps to stop its shards
JOIN_TIMEOUT_S = 5.0  # NodeAgent._join's deadline and back-off (0.5 s doubling to 5 s)
JOIN_BACKOFF_S = (0.5, 5.0)
RECV_BUFFER = 4 << 20  # the loader's UDP socket (the kernel caps it at net.core.rmem_max)
TICK_SLOT_S = 0.005  # a tick goes at most this late (the beat's latency is timed from its send)


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """One loader process: nodes `first`..`first + count - 1`, plus `churn_per_min` joins and leaves."""

    address: str
    first: int
    count: int
    heartbeat_interval_s: float = 1.0
    joins_per_s: float = 125.0  # this loader's share of the fleet's arrival rate
    metrics_every_s: float = 5.0
    churn_per_min: float = 0.0
    churn_life_s: float = 20.0
    zones: int = 4
    udp: bool = False  # heartbeat with UDP beats (gRPC as the real node's fallback) instead of gRPC only


@dataclass(eq=False)
class _Sim:
    """One simulated node: its id (it changes when it joins again), UDP key and the real node's fallback state."""

    i: int
    id: str = ""
    signer: Signer | None = None
    port: int = 0
    key: bytes = b""
    due: float = 0.0  # its next tick (monotonic)
    tick: int = 0  # the heap entry that is its next tick (others are stale)
    in_flight: bool = False  # a gRPC Heartbeat awaits its answer
    alive: bool = True  # False once it left (churn) or the loader stops
    # worker/udp_beats.UdpBeats's state, per node
    pending: dict[int, float] = field(default_factory=dict)  # counter -> sent
    last: int = 0
    answered: int = 0
    misses: int = 0
    paused_until: float = 0.0
    working: bool = False  # a beat under this key was answered
    grpc_answered: bool = False  # a gRPC Heartbeat was answered since the last UDP reply
    lease_s: float = 0.0
    hedged_at: float = -math.inf
    hedge_gap: float = 0.0

    def rekey(self, resp: pb.JoinResponse | pb.HeartbeatResponse) -> list[int]:
        """Take the port and key of `resp`; a new key starts afresh (the beats it forgets are returned)."""
        if not resp.beat_port or (resp.beat_port, resp.beat_key) == (self.port, self.key):
            return []
        self.port, self.key, self.signer = resp.beat_port, resp.beat_key, Signer(resp.beat_key)
        return self.reset(0.0)

    def reset(self, paused_until: float) -> list[int]:
        """UdpBeats._take_key / _pause: forget the beats awaiting an answer (returned); pause until then."""
        gone = list(self.pending)
        self.pending.clear()
        self.last = self.answered = self.misses = 0
        self.paused_until = paused_until
        self.working = self.grpc_answered = False
        return gone


@dataclass
class LoaderStats:
    """What one loader saw; latencies only between the parent's `measure` and `stop` events."""

    latencies_ms: list[float] = field(default_factory=list)  # every heartbeat answered: UDP beat or gRPC call
    sent: int = 0
    unknown: int = 0  # heartbeats answered known=False: the coordinator had declared the node lost
    errors: dict[str, int] = field(default_factory=dict)
    joined: int = 0
    join_attempts: int = 0
    join_ms: list[float] = field(default_factory=list)  # each answered Join call's round trip
    join_done_at: float = 0.0  # wall time the last first-join was answered
    churn_joined: int = 0
    churn_left: int = 0
    leave_undelivered: list[str] = field(default_factory=list)  # churn nodes gone without their Leave answered
    roles: int = 0
    metric_reports: int = 0
    udp_beats: int = 0  # beats sent in the window
    udp_misses: int = 0  # beats found unanswered at the next tick (UdpBeats counts these as misses)
    udp_pauses: int = 0  # nodes that turned to gRPC alone after MISSES_TO_PAUSE misses
    grpc_beats: int = 0  # gRPC Heartbeats sent in the window (the hedge, or gRPC-only nodes)
    grpc_max_in_flight: int = 0
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
                 stop: multiprocessing.synchronize.Event, joined: Any = None) -> None:
        self.cfg = cfg
        self.joined = joined  # a shared multiprocessing Value: first joins answered, read by the parent
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
        self.owner: dict[int, _Sim] = {}  # counter of a beat awaiting its reply -> its node
        self.ticks: list[tuple[float, int, _Sim]] = []  # heap of (due, seq, node)
        self.seq = 0
        self.in_flight = 0  # gRPC Heartbeats awaiting their answer, all nodes

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
            # The replies of thousands of nodes arrive on this one socket (a real node has its own):
            # a default buffer (~200 KiB, some 300 datagrams) overflowed whenever this loop was busy.
            self.udp.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
        ticker = asyncio.create_task(self._ticker())
        t0, gap = time.monotonic(), 1.0 / self.cfg.joins_per_s
        for k in range(self.cfg.count):  # machines arriving at a steady rate
            await asyncio.sleep(max(0.0, t0 + k * gap - time.monotonic()))
            self._spawn(self._node(self.cfg.first + k, life_s=None))
        if self.cfg.churn_per_min:
            self._spawn(self._churn())
        while not self.stopping:
            await asyncio.sleep(0.1)
        watcher.cancel()
        ticker.cancel()
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

    # --- joining ------------------------------------------------------------------------------
    async def _join(self, sim: _Sim) -> bool:
        """Join (again) as NodeAgent._join does; False once the loader stops."""
        i = sim.i
        stub, _ = self._stub(i)
        req = pb.JoinRequest(name=f"sim-{i}", address="127.0.0.1", hostname=f"simhost-{i}", cpus=1,
                             labels={"zone": f"z{i % self.cfg.zones}"}, node_id=sim.id or f"sim{i:08d}",
                             spot=i % 3 == 0)
        delay = JOIN_BACKOFF_S[0]
        while not self.stopping:
            self.stats.join_attempts += 1
            t0 = time.monotonic()
            try:
                resp = await stub.Join(req, timeout=JOIN_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                self._error(e)
                await asyncio.sleep(delay)
                delay = min(JOIN_BACKOFF_S[1], delay * 2)
                continue
            self.stats.join_ms.append((time.monotonic() - t0) * 1e3)
            sim.id = resp.node_id
            sim.lease_s = resp.lease_timeout_s
            if self.cfg.udp:
                self._forget(sim.rekey(resp))
            return True
        return False

    async def _node(self, i: int, life_s: float | None) -> None:
        sim = _Sim(i)
        if not await self._join(sim):
            return
        if life_s is None:
            self.stats.joined += 1
            if self.joined is not None:
                self.joined.value = self.stats.joined  # the parent waits on this, not on ListNodes (10,000 records)
            self.stats.join_done_at = time.time()
            self.stats.node_ids.append(sim.id)
        else:
            self.stats.churn_joined += 1
        # The agent's heartbeat thread starts with its first tick one interval after the join.
        self._schedule(sim, time.monotonic() + random.uniform(0.5, 1.5) * self.cfg.heartbeat_interval_s)  # noqa: S311
        watch = asyncio.create_task(self._watch(sim))
        try:
            await (asyncio.Event().wait() if life_s is None else asyncio.sleep(life_s))  # None: until the loader stops
        finally:
            sim.alive = False
            watch.cancel()
        stub, _ = self._stub(i)
        # As NodeAgent.shutdown: retried through a coordinator restart within the grace (30 s, less 5 s kept).
        failed = await deliver_leave(stub, pb.LeaveRequest(node_id=sim.id, reason="churn"),
                                     until=time.monotonic() + LEAVE_BUDGET_S)
        if failed is None:
            self.stats.churn_left += 1
        else:
            self.stats.leave_undelivered.append(sim.id)
            self.stats.errors[f"Leave {failed.name}"] = self.stats.errors.get(f"Leave {failed.name}", 0) + 1

    # --- heartbeats ---------------------------------------------------------------------------
    def _schedule(self, sim: _Sim, due: float) -> None:
        """`sim`'s next tick at `due`: replaces the one scheduled before, if any."""
        sim.due = due
        self.seq += 1
        sim.tick = self.seq
        heapq.heappush(self.ticks, (due, self.seq, sim))

    async def _ticker(self) -> None:
        """Every node's tick, from one heap, in slots of TICK_SLOT_S (one wake-up a slot, not one a node)."""
        while True:
            now = time.monotonic()
            while self.ticks and self.ticks[0][0] <= now:
                _, seq, sim = heapq.heappop(self.ticks)
                if sim.alive and seq == sim.tick:
                    self._tick(sim, now)
            await asyncio.sleep(TICK_SLOT_S)

    def _tick(self, sim: _Sim, now: float) -> None:
        """One heartbeat tick of `sim` (HeartbeatThread._run with UdpBeats.beat): UDP, gRPC, or both."""
        interval = self.cfg.heartbeat_interval_s
        sim.due = max(sim.due + interval, now)  # a fixed cadence; a late tick does not bunch the next ones up
        grpc_too = True
        if self.udp is not None and sim.signer is not None and now >= sim.paused_until:
            previous_answered = sim.last != 0 and sim.answered == sim.last
            paused = False
            if sim.last and not previous_answered:
                sim.misses += 1
                if self.measuring:
                    self.stats.udp_misses += 1
                if sim.misses >= MISSES_TO_PAUSE and sim.grpc_answered:
                    self._forget(sim.reset(now + PAUSE_BEATS * interval))
                    self.stats.udp_pauses += 1
                    paused = True
            if not paused:
                self._send(sim, now)
                hedge_after = HEDGE_MISSES if sim.lease_s >= (HEDGE_MISSES + 2) * interval else 1
                grpc_too = not sim.working or (sim.misses >= hedge_after
                                               and now - sim.hedged_at >= max(sim.hedge_gap, sim.lease_s / 3))
                if grpc_too and sim.working:
                    sim.hedged_at = now
        if grpc_too:
            self._spawn(self._grpc_heartbeat(sim))  # the thread waits for it: the next tick once it is answered
        else:
            self._schedule(sim, sim.due)

    def _send(self, sim: _Sim, now: float) -> None:
        assert self.udp is not None and sim.signer is not None
        self.counter += 1
        sim.last = self.counter
        sim.pending[self.counter] = now
        self.owner[self.counter] = sim
        while len(sim.pending) > PENDING:  # UdpBeats keeps the newest PENDING
            oldest = next(iter(sim.pending))
            del sim.pending[oldest]
            self.owner.pop(oldest, None)
        if self.measuring:
            self.stats.udp_beats += 1
        self.udp.sendto(sim.signer.beat(sim.id, self.counter), ("127.0.0.1", sim.port))

    def _forget(self, counters: list[int]) -> None:
        for c in counters:
            self.owner.pop(c, None)

    async def _grpc_heartbeat(self, sim: _Sim) -> None:
        stub, _ = self._stub(sim.i)
        sim.in_flight = True
        self.in_flight += 1
        self.stats.grpc_max_in_flight = max(self.stats.grpc_max_in_flight, self.in_flight)
        measured = self.measuring
        if measured:
            self.stats.grpc_beats += 1
        t0 = time.monotonic()
        try:
            resp = await stub.Heartbeat(pb.HeartbeatRequest(node_id=sim.id), timeout=self.cfg.heartbeat_interval_s * 3)
        except grpc.aio.AioRpcError as e:
            self._error(e)
            resp = None
        finally:
            sim.in_flight = False
            self.in_flight -= 1
        if sim.alive:
            self._schedule(sim, max(sim.due, time.monotonic()))
        took = time.monotonic() - t0
        if resp is not None and resp.known and took < self.cfg.heartbeat_interval_s:  # UdpBeats.grpc_done
            sim.grpc_answered, sim.hedge_gap = True, 0.0
        else:
            sim.hedge_gap = min(sim.lease_s, 2 * max(sim.hedge_gap, sim.lease_s / 3))
        if resp is None:
            return
        if measured and self.measuring:
            self.stats.latencies_ms.append((time.monotonic() - t0) * 1e3)
            self.stats.sent += 1
        if not resp.known:
            self.stats.unknown += 1
            if sim.alive:  # NodeAgent._leaving: a node that has left expects "unknown" and does not join again
                await self._join(sim)
        elif self.cfg.udp:
            self._forget(sim.rekey(resp))  # a new key starts afresh

    def udp_reply(self, data: bytes) -> None:
        """A reply from the beat port (UdpBeats.replies): the beat it answers is timed; "unknown" sends gRPC now."""
        now = time.monotonic()
        counter = peek_reply(data)
        sim = self.owner.get(counter) if counter is not None else None
        if sim is None or sim.signer is None:
            return
        got = sim.signer.check_reply(data)
        if got is None or got[0] not in sim.pending:
            return
        del self.owner[got[0]]
        sent = sim.pending.pop(got[0])
        if not got[1]:
            self.stats.unknown += 1
            self._forget(sim.reset(now + PAUSE_BEATS * self.cfg.heartbeat_interval_s))
            if not sim.in_flight and sim.alive:  # urgent: the thread's next tick is now, over gRPC
                sim.due = now - self.cfg.heartbeat_interval_s
                self._schedule(sim, now)
            return
        sim.answered = max(sim.answered, got[0])
        sim.misses = 0
        sim.working, sim.grpc_answered, sim.hedge_gap = True, False, 0.0
        if self.measuring:
            self.stats.latencies_ms.append((now - sent) * 1e3)
            self.stats.sent += 1

    # --- assignments, roles, metrics ------------------------------------------------------------
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
                stop: multiprocessing.synchronize.Event, out: Any, joined: Any = None) -> None:
    """Process entry point: run the nodes until `stop`, then put the LoaderStats (as a dict) on `out`;
    `joined` (a multiprocessing Value) counts the nodes joined meanwhile."""
    stats = asyncio.run(Loader(cfg, measure, stop, joined).run())
    out.put(stats.__dict__)
