"""Standby coordinators refuse every gossamer call with UNAVAILABLE, naming the leader (status text and `gossamer-leader` trailer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from gossamer.core.errors import NotLeaderError
from gossamer.core.rpc_errors import HandlerWrapper, replace_behavior

#: Trailing metadata key holding the leading coordinator's HOST:PORT (empty: none leads yet).
LEADER_KEY = "gossamer-leader"


class Leading(Protocol):
    """What the gate asks of the server: whether it leads, and who does."""

    @property
    def leading(self) -> bool: ...

    @property
    def leader_address(self) -> str: ...


class LeaderGate(HandlerWrapper):
    """Passes calls through while the server leads; otherwise ends them with UNAVAILABLE at once.

    Clients given every coordinator address route by the health service (a standby reports
    NOT_SERVING), so they reach this only in the moment a lead changes hands, and retry.
    """

    def __init__(self, server: Leading, prefix: str = "/gossamer.") -> None:
        super().__init__()
        self.server = server
        self.prefix = prefix

    def applies(self, handler: grpc.RpcMethodHandler, method: str) -> bool:
        return not self.server.leading and method.startswith(self.prefix)

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return replace_behavior(handler, lambda _, gen: self._refuse_stream if gen else self._refuse)

    async def _abort(self, context: grpc.aio.ServicerContext) -> None:
        leader = self.server.leader_address
        context.set_trailing_metadata(((LEADER_KEY, leader),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(NotLeaderError(leader)))

    async def _refuse(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._abort(context)

    async def _refuse_stream(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await self._abort(context)
        yield  # an async generator, as the handler it replaces
