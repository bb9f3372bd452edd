"""A node's Leave, delivered through a coordinator restart or failover while the node's grace lasts."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

#: Codes a coordinator that is restarting, failing over or shedding load answers with: worth sending again.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
ATTEMPT_S = 3.0
BACKOFF_S = (0.2, 2.0)
#: How often a Leave still not delivered says so again (the first refusal is said at once).
REPEAT_S = 10.0



@dataclass(frozen=True)
class GraceSplit:
    """How a leaving node spends its grace (pure arithmetic, times passed in): the workers' stop, the shards'
    final checkpoints, the Leave, and the shards' stop once the Leave is answered."""

    #: Kept to stop the shards once the Leave is answered: a quarter of the grace, at most 5 s.
    reserve_s: float
    #: The Leave's one whole attempt: one cut short leaves the node counted lost, its shards' backups waiting
    #: for a lease to run out (a loaded coordinator may take seconds to answer).
    leave_s: float

    @classmethod
    def of(cls, grace_s: float) -> GraceSplit:
        return cls(reserve_s=min(5.0, 0.25 * grace_s), leave_s=min(ATTEMPT_S, 0.3 * grace_s))

    def workers_s(self, left: float) -> float:
        """The workers' stop, with `left` seconds of grace: 0.6 of it, less where the Leave and reserve need it."""
        return max(0.0, min(0.6 * left, left - self.reserve_s - self.leave_s))

    def checkpoints_s(self, left: float) -> float:
        """The shards' final checkpoints, with `left` seconds of grace: what the Leave and the reserve leave."""
        return max(0.0, left - self.reserve_s - max(self.reserve_s, self.leave_s))

    def leave_until(self, now: float, deadline: float) -> float:
        """When the Leave is given up: the grace less the reserve, but never before one whole attempt."""
        return max(now + max(1.0, self.leave_s), deadline - self.reserve_s)

async def deliver_leave(stub: Any, request: pb.LeaveRequest, *, until: float) -> grpc.StatusCode | None:
    """Send `request` (a NodeServiceStub's Leave) until it is answered or `until` (time.monotonic()) passes.

    None once delivered, else the code of the last failure. A node that left without saying so is
    counted lost only when its lease runs out, and its shards' backups wait that long to be
    promoted; a Leave sent once into a coordinator's restart (a second or two, or an HA failover)
    would do exactly that, so transient failures are retried. Leave is idempotent on the server.
    """
    delay, warned, started = BACKOFF_S[0], False, time.monotonic()
    said = started
    while True:
        left = until - time.monotonic()
        try:
            # Queued until the channel connects (within the attempt), not failed at once: it goes out
            # the moment the restarted coordinator answers the channel's next dial.
            await stub.Leave(request, timeout=max(0.05, min(ATTEMPT_S, left)), wait_for_ready=True)
            if warned:
                log.info("Leave delivered")
            return None
        except grpc.RpcError as e:
            code = e.code()
            if code not in TRANSIENT or time.monotonic() + delay >= until:
                return code
            now = time.monotonic()
            if not warned:
                log.warning("Leave not delivered yet (%s); retrying for up to %.0f s", code.name, until - now)
                warned = True
            elif now - said >= REPEAT_S:
                log.info("Leave still not delivered after %.0f s (%s)", now - started, code.name)
                said = now
        await asyncio.sleep(delay)
        delay = min(BACKOFF_S[1], delay * 2)
