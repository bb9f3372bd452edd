"""A node's Leave, delivered through a coordinator restart or failover while the node's grace lasts."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

#: Codes a coordinator that is restarting, failing over or shedding load answers with: worth sending again.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
ATTEMPT_S = 3.0
BACKOFF_S = (0.2, 2.0)


async def deliver_leave(stub: Any, request: pb.LeaveRequest, *, until: float) -> grpc.StatusCode | None:
    """Send `request` (a NodeServiceStub's Leave) until it is answered or `until` (time.monotonic()) passes.

    None once delivered, else the code of the last failure. A node that left without saying so is
    counted lost only when its lease runs out, and its shards' backups wait that long to be
    promoted; a Leave sent once into a coordinator's restart (a second or two, or an HA failover)
    would do exactly that, so transient failures are retried. Leave is idempotent on the server.
    """
    delay, warned = BACKOFF_S[0], False
    while True:
        left = until - time.monotonic()
        try:
            await stub.Leave(request, timeout=max(0.05, min(ATTEMPT_S, left)))
            if warned:
                log.info("Leave delivered")
            return None
        except grpc.RpcError as e:
            code = e.code()
            if code not in TRANSIENT or time.monotonic() + delay >= until:
                return code
            if not warned:
                log.warning("Leave not delivered yet (%s); retrying for up to %.0f s", code.name,
                            until - time.monotonic())
                warned = True
        await asyncio.sleep(delay)
        delay = min(BACKOFF_S[1], delay * 2)
