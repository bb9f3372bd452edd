"""Sends a role's metrics and state to the coordinator from a background thread; never blocks training."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import grpc

from gossamer.security.channel import ChannelSecurity, open_channel
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_MAX_BUFFERED = 10_000


class Reporter:
    """One gRPC channel per role process (opened here, after spawn).

    `security`: the node's TLS settings and token, as a `ChannelSecurity` or the spec the
    node agent hands its role processes (paths only; the files are read here).
    """

    def __init__(self, coordinator: str, experiment_id: str, source: str, interval_s: float = 1.0,
                 security: ChannelSecurity | dict[str, Any] | None = None) -> None:
        self.coordinator = coordinator
        self.experiment_id = experiment_id
        self.source = source
        self.interval_s = interval_s
        if isinstance(security, dict):
            security = ChannelSecurity.from_spec(security)
        self._channel = open_channel(coordinator, security)
        self._nodes = pb_grpc.NodeServiceStub(self._channel)
        self._exps = pb_grpc.ExperimentServiceStub(self._channel)
        self._ckpt = pb_grpc.CheckpointServiceStub(self._channel)
        self._points: queue.Queue[pb.MetricPoint] = queue.Queue()
        self._pending: list[pb.MetricPoint] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.running = True  # False once the coordinator says the experiment is over
        self._thread = threading.Thread(target=self._loop, name="gossamer-reporter", daemon=True)
        self._thread.start()

    def metric(self, step: int, values: dict[str, float]) -> None:
        if self._points.qsize() < _MAX_BUFFERED:
            self._points.put(pb.MetricPoint(time_unix=time.time(), step=step, values=values, source=self.source))

    def _loop(self) -> None:
        warned = False
        while not self._stop.is_set():
            self._stop.wait(self.interval_s)
            try:
                self._send_pending()
                warned = False
            except grpc.RpcError as e:
                if not warned:
                    log.warning("metrics not delivered (%s); buffering and retrying", e.code())
                    warned = True
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    with self._lock:
                        self._pending = []  # refused for good (e.g. unknown experiment): drop

    def _send_pending(self) -> None:
        """Send every queued point, oldest first; one sender at a time, so points never overtake."""
        with self._lock:
            self._pending.extend(self._drain())
            if not self._pending:
                return
            resp = self._exps.ReportMetrics(
                pb.ReportMetricsRequest(experiment_id=self.experiment_id, points=self._pending[-_MAX_BUFFERED:]),
                timeout=5.0,
            )
            self._pending = []
            self.running = resp.running

    def _drain(self) -> list[pb.MetricPoint]:
        out = []
        while True:
            try:
                out.append(self._points.get_nowait())
            except queue.Empty:
                return out

    def flush(self, timeout: float = 10.0) -> bool:
        """Send everything queued now, the reporter thread's batch in flight included (bounded by `timeout`);
        whether it was delivered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._send_pending()
                return True
            except grpc.RpcError:
                time.sleep(0.5)
        return False

    def role(self, node_id: str, role: pb.Role.ValueType, index: int, state: pb.RoleState.ValueType, endpoint: str = "", message: str = "",
             retry_s: float = 60.0, **extra: object) -> None:
        """Report the role's state, retrying while the coordinator is unreachable.

        `extra`: ReportRoleRequest fields of parameter servers (replica, replicated, version,
        restored_from).
        """
        req = pb.ReportRoleRequest(
            node_id=node_id, experiment_id=self.experiment_id, role=role, index=index, state=state,
            endpoint=endpoint, message=message[:2000], **extra,  # type: ignore[arg-type]
        )
        self._retry(lambda: self._nodes.ReportRole(req, timeout=5.0), retry_s)

    def complete(self, node_id: str, final: dict[str, float], checkpoint: str, retry_s: float = 600.0) -> None:
        req = pb.CompleteExperimentRequest(
            experiment_id=self.experiment_id, node_id=node_id, final_metrics=final, checkpoint=checkpoint
        )
        self._retry(lambda: self._exps.Complete(req, timeout=10.0), retry_s)

    def checkpoint(self, step: int, path: str, kind: str, node_id: str = "") -> None:
        """Register a checkpoint written on node `node_id`'s disk ("": not said)."""
        self.register(step, path, kind, node_id)

    def register(self, step: int, path: str, kind: str, node_id: str = "", retry_s: float = 30.0) -> bool:
        """`checkpoint`, retried for `retry_s` at most; whether the coordinator took it."""
        info = pb.CheckpointInfo(experiment_id=self.experiment_id, step=step, path=path, kind=kind, node_id=node_id)
        return self._retry(lambda: self._ckpt.Register(pb.RegisterCheckpointRequest(checkpoint=info),
                                                       timeout=max(0.1, min(5.0, retry_s))), retry_s)

    def _retry(self, call, retry_s: float) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + retry_s
        while True:
            try:
                call()
                return True
            except grpc.RpcError as e:
                retryable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retryable or time.monotonic() > deadline:
                    log.error("coordinator call failed: %s %s", e.code(), e.details())
                    return False
                time.sleep(0.5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._channel.close()
