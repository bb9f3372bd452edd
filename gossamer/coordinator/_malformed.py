"""Requests whose body does not parse get INVALID_ARGUMENT, not grpc.aio's UNKNOWN and an ERROR traceback each."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gossamer.core.rpc_errors import HandlerWrapper

log = logging.getLogger(__name__)

_MALFORMED = object()


class MalformedRequestInterceptor(HandlerWrapper):
    """Wraps each unary-request handler so an unparsable body is refused with a clear status.

    Without it grpc.aio treats the deserializer's DecodeError as a servicer crash: status
    UNKNOWN, and a full traceback logged at ERROR for every such request (a cheap way to
    flood the coordinator's log). Refusals are counted in `refused` and logged at most once
    every few seconds.
    """

    def __init__(self, log_every_s: float = 5.0) -> None:
        super().__init__()
        self.refused = 0
        self._log_every_s = log_every_s
        self._logged = 0.0

    def applies(self, handler: grpc.RpcMethodHandler, method: str) -> bool:
        return not handler.request_streaming and handler.request_deserializer is not None

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        parse = handler.request_deserializer

        def tolerant(raw: bytes) -> Any:
            try:
                return parse(raw)
            except Exception:  # noqa: BLE001 — protobuf's DecodeError and whatever a parser raises
                return _MALFORMED

        async def refuse(context: grpc.aio.ServicerContext) -> None:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged >= self._log_every_s:
                self._logged = now
                log.warning("refused a request to %s whose body does not parse (%d so far)", method, self.refused)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request body is not a valid {method} request")

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if request is _MALFORMED:
                    await refuse(context)
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

            return handler._replace(request_deserializer=tolerant, unary_unary=unary_unary)
        inner_stream = handler.unary_stream
        if inspect.isasyncgenfunction(inner_stream):

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if request is _MALFORMED:
                    await refuse(context)
                async for item in inner_stream(request, context):
                    yield item

            return handler._replace(request_deserializer=tolerant, unary_stream=unary_stream)

        async def unary_stream_writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _MALFORMED:
                await refuse(context)
            return await inner_stream(request, context)  # writes with context.write

        return handler._replace(request_deserializer=tolerant, unary_stream=unary_stream_writer)
