"""The coordinator's gRPC server: thin servicers over `Coordinator`, the health service, the lease reaper."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossamer.coordinator import grpc_logs, views
from gossamer.coordinator._malformed import MalformedRequestInterceptor
from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.core import Coordinator, wait_event
from gossamer.coordinator.election import Election
from gossamer.coordinator.health import HealthService
from gossamer.coordinator.http import VIEWER_TOKEN_FILE, HttpConfig, StatusHttp
from gossamer.coordinator.leader_gate import LeaderGate
from gossamer.coordinator.pg_store import PgStore
from gossamer.coordinator.retention import keep_bounded
from gossamer.coordinator.role_logs import RoleLogReads
from gossamer.coordinator.serving import describe_security, server_interceptors, warn_if_open
from gossamer.coordinator.udp_beats import UdpBeats
from gossamer.core.errors import ConfigError, NotFoundError
from gossamer.core.rpc_errors import ErrorStatusInterceptor
from gossamer.security.certs import write_private
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = ("gossamer.v1.NodeService", "gossamer.v1.ExperimentService", "gossamer.v1.CheckpointService")


# ----------------------------------------------------------------------------------------------
# Servicers: translate RPCs; what they raise becomes a status in one place (ErrorStatusInterceptor).
# ----------------------------------------------------------------------------------------------
class NodeServicer(pb_grpc.NodeServiceServicer):
    def __init__(self, server: CoordinatorServer) -> None:
        self._server = server

    @property
    def c(self) -> Coordinator:
        return self._server.leader_state()

    async def Join(self, request, context):  # type: ignore[no-untyped-def]
        resp = await self.c.join(request)
        self._server.beats.issue(self.c, resp.node_id, resp, fresh=True)
        return resp

    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        resp = pb.HeartbeatResponse(known=await self.c.heartbeat(request.node_id))
        # The beat port and key again: a node keyed by a coordinator that restarted or lost the lead
        # since gets this one's (the same key until it joins again).
        self._server.beats.issue(self.c, request.node_id, resp, fresh=False)
        return resp

    async def Leave(self, request, context):  # type: ignore[no-untyped-def]
        await self.c.leave(request.node_id, request.reason)
        return pb.LeaveResponse()

    async def WatchAssignments(self, request, context) -> AsyncIterator[pb.AssignmentSet]:  # type: ignore[no-untyped-def,override]
        if request.node_id not in self.c.nodes:
            raise NotFoundError(f"node {request.node_id} is not known; join first")
        last: bytes | None = None
        self.c.stream_changed(request.node_id, is_open=True)
        try:
            while True:
                changed = self.c.streams.event(request.node_id)  # before reading: no change slips by
                assignments = self.c.assignments_for(request.node_id)
                blob = b"".join(a.SerializeToString(deterministic=True) for a in assignments)
                if blob != last:
                    last = blob
                    yield pb.AssignmentSet(serial=time.time_ns(), assignments=assignments)
                    self.c.streams.sent(request.node_id, bool(assignments))
                await wait_event(changed, timeout=15.0)
        finally:  # the node's connection is gone (or it reconnects): evidence for the reaper
            self.c.stream_changed(request.node_id, is_open=False)

    async def ReportRole(self, request, context):  # type: ignore[no-untyped-def]
        await self.c.report_role(request)
        return pb.ReportRoleResponse()

    async def ListNodes(self, request, context):  # type: ignore[no-untyped-def]
        nodes = sorted(self.c.nodes.values(), key=lambda n: n.joined_unix)
        return pb.ListNodesResponse(nodes=[views.node_info(n, self.c.exps.get(n.experiment_id), time.time()) for n in nodes])

    async def FetchWorkdir(self, request, context) -> AsyncIterator[pb.WorkdirChunk]:  # type: ignore[no-untyped-def,override]
        async for piece in self.c.workdir_pieces(request):
            yield piece


class ExperimentServicer(pb_grpc.ExperimentServiceServicer):
    def __init__(self, server: CoordinatorServer) -> None:
        self._server = server
        self._role_logs = RoleLogReads()

    @property
    def c(self) -> Coordinator:
        return self._server.leader_state()

    async def Submit(self, request, context):  # type: ignore[no-untyped-def]
        return pb.SubmitResponse(experiment_id=await self.c.submit(request.experiment_json))

    async def UploadWorkdir(self, request_iterator, context):  # type: ignore[no-untyped-def]
        return await self.c.upload_workdir(request_iterator)

    async def Get(self, request, context):  # type: ignore[no-untyped-def]
        return self.c.status(self.c.get(request.experiment_id))

    async def List(self, request, context):  # type: ignore[no-untyped-def]
        exps = sorted(self.c.exps.values(), key=lambda e: e.seq)
        return pb.ListExperimentsResponse(experiments=[self.c.status(e) for e in exps])

    async def Watch(self, request, context) -> AsyncIterator[pb.ExperimentStatus]:  # type: ignore[no-untyped-def,override]
        exp = self.c.get(request.experiment_id)
        last = None
        while True:
            status = self.c.status(exp)
            blob = status.SerializeToString(deterministic=True)
            if blob != last:
                last = blob
                yield status
            if not exp.active:
                return
            await asyncio.sleep(0.25)  # at most four updates a second
            await self.c.wait_change(timeout=2.0)

    async def Cancel(self, request, context):  # type: ignore[no-untyped-def]
        return self.c.status(await self.c.cancel(request.experiment_id))

    async def ReportMetrics(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ReportMetricsResponse(running=await self.c.report_metrics(request))

    async def GetMetrics(self, request, context):  # type: ignore[no-untyped-def]
        self.c.get(request.experiment_id)
        page = await self.c.store.metric_page(request.experiment_id, request.since_unix, request.max_points,
                                              request.page_token)
        return pb.GetMetricsResponse(
            points=[pb.MetricPoint(time_unix=p.time, step=p.step, source=p.source, values=p.values, count=p.count,
                                   min_values=p.lo, max_values=p.hi) for p in page.points],
            next_page_token=page.next_token, bucket_s=page.bucket_s,
        )

    async def Complete(self, request, context):  # type: ignore[no-untyped-def]
        await self.c.complete(request)
        return pb.CompleteExperimentResponse()

    async def ListEvents(self, request, context):  # type: ignore[no-untyped-def]
        rows = await self.c.store.events(request.experiment_id or None, request.since_unix)
        return pb.ListEventsResponse(events=[
            pb.Event(time_unix=e["time"], experiment_id=e["experiment_id"], node_id=e["node_id"], kind=e["kind"],
                     message=e["message"])
            for e in rows
        ])


    async def GetRoleLog(self, request, context):  # type: ignore[no-untyped-def]
        return await self._role_logs.read(self.c.state, request)


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    def __init__(self, server: CoordinatorServer) -> None:
        self._server = server

    @property
    def c(self) -> Coordinator:
        return self._server.leader_state()

    async def Register(self, request, context):  # type: ignore[no-untyped-def]
        await self.c.register_checkpoint(request.checkpoint)
        return pb.RegisterCheckpointResponse()

    async def Latest(self, request, context):  # type: ignore[no-untyped-def]
        row = await self.c.store.latest_checkpoint(request.experiment_id)
        if row is None:
            raise NotFoundError(f"no checkpoint for {request.experiment_id!r}")
        step, path, kind, t = row
        return pb.LatestCheckpointResponse(
            checkpoint=pb.CheckpointInfo(
                experiment_id=request.experiment_id, step=step, path=path, kind=kind, time_unix=t
            )
        )


class CoordinatorServer:
    """A running coordinator: grpc.aio server, health service, lease reaper."""

    def __init__(self, config: CoordinatorConfig, http: HttpConfig | None = None) -> None:
        self.config = config
        self.http_config = http  # the status page and /metrics; None: not served
        self.http: StatusHttp | None = None
        self.http_port = 0
        self.coord: Coordinator | None = None
        self.server: grpc.aio.Server | None = None
        self.health = HealthService()
        self.port = 0
        self._reaper: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._retention: asyncio.Task[None] | None = None
        self._stopping = False
        self.restarts = 0  # gRPC servers brought back after a malformed request stopped one
        #: With a PostgreSQL state (`config.replicated`): whether this process leads, and who does.
        self.leading = True
        self.advertised = ""
        self.pg: PgStore | None = None
        self.election: Election | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()  # set when a leader lost its lead: `serve` then ends the process
        self.malformed = MalformedRequestInterceptor()  # .refused: requests whose body did not parse
        self.beats = UdpBeats(self, interval_s=config.heartbeat_interval_s)  # port 0: not serving (udp_beats off)

    @property
    def malformed_refused(self) -> int:
        """Requests refused because their body did not parse."""
        return self.malformed.refused

    @property
    def beats_served(self) -> int:
        """UDP heartbeats answered."""
        return self.beats.served

    @property
    def beats_dropped(self) -> dict[str, int]:
        """UDP datagrams dropped unanswered, by reason (udp_beats.DROP_REASONS)."""
        return self.beats.dropped

    async def start(self) -> int:
        """Serve; with a PostgreSQL state, stand by until this process takes the lead (docs/ha.md)."""
        grpc_logs.install()
        if self.config.replicated:
            self.leading = False
            self.pg = PgStore(self.config.state)
            await self._report(health_pb2.HealthCheckResponse.NOT_SERVING)  # clients route to the leader
            self.port = await self._start_grpc(self.config.port)
            await self._start_beats()
            self.advertised = self.config.advertise or _advertise(self.config.host, self.port)
            self._keeper = asyncio.create_task(self._keep_serving())
            self.election = Election(self.pg, self.advertised, self._take_lead, self._lose_lead)
            await self.election.start()
            return self.port
        self.coord = Coordinator(self.config)
        self.coord.grpc_server = self
        self.port = await self._start_grpc(self.config.port)
        await self._start_beats()
        self._keeper = asyncio.create_task(self._keep_serving())
        await self._lead()
        return self.port

    @property
    def leader_address(self) -> str:
        """Who leads, as far as this process knows ("" before any did)."""
        if self.leading:
            return self.advertised or f"{self.config.host}:{self.port}"
        return self.election.leader if self.election is not None else ""

    def leader_state(self) -> Coordinator:
        """The state a leading server acts on (the gate lets no call through before there is one)."""
        assert self.coord is not None
        return self.coord

    async def _take_lead(self, term: int) -> None:
        assert self.pg is not None
        self.coord = Coordinator(self.config, store=self.pg)
        self.coord.grpc_server = self
        self.leading = True
        await self._lead()
        log.info("leading as term %d (state in %s)", term, self.pg.location)

    def _lose_lead(self, why: str) -> None:
        """Stop acting at once: every call refused, nothing more reaped or written; `lost` ends `serve`."""
        if not self.leading:
            return
        log.critical("lost the lead (%s): refusing every call and stopping", why)
        self.leading = False
        if self.election is not None:
            self.election.deposed()
        for task in (self._reaper, self._retention):
            if task is not None:
                task.cancel()
        self._health_task = asyncio.create_task(self._report(health_pb2.HealthCheckResponse.NOT_SERVING))
        self.lost.set()

    async def _report(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        """The health service's answer for the server and every gossamer service."""
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def _lead(self) -> None:
        """Act on the state: report SERVING (clients route here), reap leases, keep state bounded, HTTP."""
        assert self.coord is not None
        await self._report(health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap())
        self._retention = asyncio.create_task(keep_bounded(self.coord))
        await self.coord.reconcile()
        if self.http_config is not None:
            self.http = StatusHttp(self.coord, self.http_config)
            self.http_port = await self.http.start()
            http_file = Path(self.config.state_dir) / "http.port"
            http_file.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{http_file}.tmp").write_text(str(self.http_port))
            os.replace(f"{http_file}.tmp", http_file)
            log.info("status page and /metrics on http://%s:%d/%s", self.http_config.host, self.http_port,
                     self._viewer_token_note())
            warn_if_open("HTTP side (status page, /api, /metrics)", self.http_config.host, self.config,
                         tls_applies=False, guarded=self.http.gate is not None)  # plain HTTP: only a token guards it
        log.info("coordinator serving on %s:%d (state in %s; %s)", self.config.host, self.port,
                 self.coord.store.location, describe_security(self.config))

    def _viewer_token_note(self) -> str:
        """Where the operator finds the HTTP side's viewer token ("" when the side is open); a derived one
        is written to STATE_DIR/viewer.token (0600) first, so a person or a scraper can be given it."""
        if self.http is None or self.http.gate is None:
            return ""
        if self.config.viewer_token_file:
            return f" (viewer token in {self.config.viewer_token_file})"
        viewer = self.config.viewer_token()
        assert viewer is not None  # a gate without a viewer file has a join token to derive it from
        path = Path(self.config.state_dir) / VIEWER_TOKEN_FILE
        write_private(path, f"{viewer}\n".encode())
        return f" (viewer token in {path}: open /?token=$(cat {path}) once in a browser)"

    async def _start_grpc(self, port: int) -> int:
        """Build, bind and start the gRPC server on `port` (0: a free one); returns the bound port."""
        server = grpc.aio.server(
            interceptors=[*server_interceptors(self.config), self.malformed, LeaderGate(self), ErrorStatusInterceptor()],
            options=[("grpc.max_receive_message_length", self.config.max_message_bytes), ("grpc.so_reuseport", 0),
                     # A node cut off without its connection closing (a partition, a machine gone)
                     # has its streams closed within about 30 s: evidence for the reaper when its
                     # lease is held because the coordinator is behind (Coordinator.reap_leases).
                     ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)],
        )
        pb_grpc.add_NodeServiceServicer_to_server(NodeServicer(self), server)
        pb_grpc.add_ExperimentServiceServicer_to_server(ExperimentServicer(self), server)
        pb_grpc.add_CheckpointServiceServicer_to_server(CheckpointServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        bind, tls = f"{self.config.host}:{port}", self.config.tls
        bound = server.add_secure_port(bind, tls.server_credentials()) if tls else server.add_insecure_port(bind)
        if bound == 0:
            raise ConfigError("port", f"cannot bind {self.config.host}:{port}")
        await server.start()
        self.server = server
        return bound

    async def _start_beats(self) -> None:
        """Open the UDP heartbeat port (udp_beats.py) unless `udp_beats` is off."""
        if not self.config.udp_beats:
            return
        wanted = self.config.beat_port
        try:  # by default the gRPC port's number (one number to open), any free one when that is 0
            await self.beats.start(self.config.host, (self.config.port and self.port) if wanted is None else wanted)
        except OSError as e:
            if wanted is not None:
                raise ConfigError("beat_port", f"cannot bind UDP {self.config.host}:{wanted}: {e}") from None
            log.warning("UDP port %d is taken (%s): UDP heartbeats on a free port instead", self.port, e)
            await self.beats.start(self.config.host, 0)
        log.info("UDP heartbeats on %s:%d", self.config.host, self.beats.port)

    async def _keep_serving(self) -> None:
        """Start the gRPC server again, same port and state, whenever it stops on its own.

        grpc.aio (grpcio 1.85) shuts its whole server down when a single request's HTTP/2
        :path is not UTF-8 (its serving loop decodes the method name unchecked), so one
        malformed frame from anyone who reaches the port would end the coordinator's service.
        """
        while not self._stopping:
            server = self.server
            assert server is not None
            try:
                if await server.wait_for_termination(timeout=0.25):
                    continue  # still serving
                why = "stopped"
            except Exception as e:  # noqa: BLE001 — what crashed it
                why = f"{type(e).__name__}: {e}"
            if self._stopping:
                return
            log.warning("gRPC server on port %d stopped by a request (%s); serving again", self.port, why[:200])
            try:  # a crashed server never finishes its own shutdown: cancel its calls, free the port
                await asyncio.wait_for(server.stop(0), 5)
            except Exception:  # noqa: BLE001
                log.warning("the stopped gRPC server did not shut down cleanly", exc_info=True)
            while not self._stopping:
                try:
                    await self._start_grpc(self.port)
                    self.restarts += 1
                    break
                except Exception:  # noqa: BLE001 — the port may take a moment to come free
                    log.exception("gRPC server could not restart on port %d; retrying", self.port)
                    await asyncio.sleep(0.5)

    async def _reap(self) -> None:
        assert self.coord is not None
        tick = self.coord.blind.tick_s  # BlindTime takes what lies beyond it for the coordinator's own
        while True:
            due = time.monotonic() + tick
            await asyncio.sleep(tick)
            try:
                await self.coord.reap_leases(lag_s=time.monotonic() - due, sweep=True)
                await self.coord.check_deadlines()
            except Exception:  # noqa: BLE001 — the reaper must survive anything
                log.exception("lease reaper")

    async def stop(self) -> None:
        self._stopping = True
        self.leading = False  # a stopping server acts no more (and a standby never did)
        if self._keeper is not None:
            self._keeper.cancel()
        if self.election is not None:
            await self.election.stop()
        await self.health.enter_graceful_shutdown()
        self.beats.close()
        if self.http is not None:
            await self.http.stop()
        if self._reaper is not None:
            self._reaper.cancel()
        if self._retention is not None:
            self._retention.cancel()
        if self.server is not None:
            await self.server.stop(self.config.grace_s)
        if self.coord is not None:
            self.coord.store.close()
        elif self.pg is not None:
            self.pg.close()

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def serve(config: CoordinatorConfig, ready_file: str | None = None, http: HttpConfig | None = None) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0), or until a leader loses its lead (3: started
    again, it stands by). With `http`, the status page and /metrics are served while leading,
    and the bound HTTP port is written to `<state_dir>/http.port`.
    """
    srv = CoordinatorServer(config, http)
    port = await srv.start()
    if ready_file:
        tmp = f"{ready_file}.tmp"
        Path(tmp).write_text(str(port))
        os.replace(tmp, ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped, lost = asyncio.create_task(stop.wait()), asyncio.create_task(srv.lost.wait())
    await asyncio.wait({stopped, lost}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    lost.cancel()
    if srv.lost.is_set():
        config = replace(config, grace_s=0.0)  # a deposed leader ends its calls now
        srv.config = config
    log.info("shutting down")
    await srv.stop()
    return 3 if srv.lost.is_set() else 0


def _advertise(host: str, port: int) -> str:
    """HOST:PORT for other coordinators to name: the host name when `host` is every interface."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"
