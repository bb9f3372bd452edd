"""The coordinator's health service: Watch streams cancelled mid-flight end quietly (no ERROR in its log)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.timeout(120)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture
def errors() -> Iterator[_Errors]:
    handler = _Errors()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


def test_watch_streams_cancelled_mid_flight_log_no_error(start_coordinator, errors: _Errors) -> None:  # type: ignore[no-untyped-def]
    """Watchers cancelled while the status flips: some writes meet calls their client has just cancelled.

    Without a cancellation-safe Watch, grpc.aio logged "ExecuteBatchError raised in core by servicer
    method [/grpc.health.v1.Health/Watch]" at ERROR for about 1 in 15,000 such cancellations here.
    """
    c = start_coordinator(rate_limit=0.0)  # thousands of calls a second from one host
    stop = threading.Event()

    async def flip() -> None:
        status = SERVING
        while not stop.is_set():
            status = NOT_SERVING if status == SERVING else SERVING
            await c.server.health.set("", status)
            await asyncio.sleep(0.0005)
        await c.server.health.set("", SERVING)

    flipping = asyncio.run_coroutine_threadsafe(flip(), c.loop)
    cancelled = 0
    try:
        with grpc.insecure_channel(c.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while cancelled < 4000:
                calls = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(20)]
                for i, call in enumerate(calls):
                    if i % 2:  # half cancelled before their first answer, half after
                        assert next(call).status in (SERVING, NOT_SERVING)
                    call.cancel()
                    cancelled += 1
            stop.set()
            flipping.result(30)
            # The service still answers, and a new watcher sees the latest status.
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest())
            assert next(watch).status == SERVING
            watch.cancel()
    finally:
        stop.set()
    c.close()  # every handler ended (or was cancelled) before the records are read
    assert not errors.records, errors.records[:3]
