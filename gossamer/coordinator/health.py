"""The coordinator's gRPC health service (grpc.health.v1), whose Watch ends quietly when its client cancels."""

from __future__ import annotations

import asyncio
from typing import TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Status: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType

#: How long a Watch whose write failed waits for gRPC to report its client gone before it
#: counts the failure as an error after all.
CANCEL_NOTICE_S = 30.0


class HealthService(health_pb2_grpc.HealthServicer):
    """Check and Watch over per-service statuses, as grpc_health's aio servicer, but cancellation-safe.

    A client that cancels a Watch (a channel's health checker whose subchannel closes) is
    normal. grpc_health's servicer then may write to the dead call: the write fails with an
    ExecuteBatchError, and grpc.aio logs it at ERROR unless it has already processed the
    client's close, which on a loaded machine it often has not. Here a failed write waits
    for that notice (gRPC then cancels the handler, logged at DEBUG) instead of raising.
    """

    def __init__(self) -> None:
        self._status: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Event()  # replaced by a fresh one at every change
        self._shutting_down = False

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 — the gRPC method's name
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 — the gRPC method's name
                    context: grpc.aio.ServicerContext) -> None:
        last: Status | None = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:  # statuses in between may be skipped: watchers want the latest
                try:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                except Exception:  # noqa: BLE001 — grpc.aio's ExecuteBatchError is private
                    await asyncio.sleep(CANCEL_NOTICE_S)  # cancelled here once gRPC sees the client gone
                    raise
                last = status
            await changed.wait()

    async def set(self, service: str, status: Status) -> None:
        """`service`'s status from now on (ignored once shutting down)."""
        if not self._shutting_down:
            self._set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good."""
        self._shutting_down = True
        for service in list(self._status):
            self._set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set(self, service: str, status: Status) -> None:
        self._status[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
