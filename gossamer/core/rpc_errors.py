"""The one place that maps gossamer errors to gRPC status codes (every server handler) and back (clients)."""

from __future__ import annotations

import abc
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from gossamer.core import errors

log = logging.getLogger(__name__)

_TO_CODE: list[tuple[type[Exception], grpc.StatusCode]] = [
    (errors.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
]


def code_for(exc: Exception) -> grpc.StatusCode:
    for kind, code in _TO_CODE:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def detail(text: str, limit: int = 1024) -> str:
    """A status message short enough for clients' 16 KiB metadata limit (ids in it come from requests)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def abort_for(context: grpc.aio.ServicerContext, exc: Exception, method: str = "") -> NoReturn:
    """End the call with the status for `exc`: its code for a GossamerError, else INTERNAL (logged)."""
    if isinstance(exc, errors.GossamerError):
        await context.abort(code_for(exc), detail(str(exc)))
    log.error("internal error in %s", method or "a handler", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, detail(f"{type(exc).__name__}: {exc}"))
    raise AssertionError("context.abort returned")  # it always raises


class HandlerWrapper(grpc.aio.ServerInterceptor):
    """A server interceptor that hands the handlers it `applies` to over to `wrap`, each wrapped once.

    The wrapped handler is kept per method, not made at every call: a heartbeat per node per
    second made the wrapping a cost of its own. `applies` is asked at every call.
    """

    def __init__(self) -> None:
        # method -> (the handler it was given, the wrapped one)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    @abc.abstractmethod
    def applies(self, handler: grpc.RpcMethodHandler, method: str) -> bool:
        """Whether this call's handler is wrapped (the others pass through as they are)."""

    @abc.abstractmethod
    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """`handler` of `method`, wrapped."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self.applies(handler, method):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


class ErrorStatusInterceptor(HandlerWrapper):
    """Wraps every handler of the services under `prefix` so what it raises becomes a status.

    A GossamerError gets its code (`code_for`) and message; anything else INTERNAL with the
    exception's type and message, and a logged traceback, instead of grpc.aio's bare UNKNOWN.
    A status the handler chose itself (`context.abort`) passes through. Streaming responses
    are wrapped too: an error after some messages ends the stream with its status.
    """

    def __init__(self, prefix: str = "/gossamer.") -> None:
        super().__init__()
        self.prefix = prefix

    def applies(self, handler: grpc.RpcMethodHandler, method: str) -> bool:
        return method.startswith(self.prefix)

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return replace_behavior(handler, lambda inner, gen: (_guard_stream if gen else _guard_call)(inner, method))


def replace_behavior(handler: grpc.RpcMethodHandler,
                     make: Callable[[Callable[..., Any], bool], Callable[..., Any]]) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour swapped for `make(behaviour, is_async_generator)` (server interceptors)."""
    for kind in ("unary_unary", "stream_unary", "unary_stream", "stream_stream"):
        inner = getattr(handler, kind)
        if inner is not None:
            return handler._replace(**{kind: make(inner, inspect.isasyncgenfunction(inner))})
    return handler


def _guard_call(inner: Callable[..., Any], method: str) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 — every error ends as a status, never a crash
            await abort_for(context, e, method)

    return call


def _guard_stream(inner: Callable[..., AsyncGenerator[Any, None]], method: str) -> Callable[..., AsyncIterator[Any]]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            # aclosing: a cancelled call runs the handler's `finally` now, not when collected
            async with contextlib.aclosing(inner(request, context)) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await abort_for(context, e, method)

    return stream


def from_rpc_error(err: grpc.RpcError, target: str) -> errors.GossamerError:
    """Turn a client-side RpcError into the matching gossamer error with a one-line message."""
    code = err.code() if hasattr(err, "code") else None
    text = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, msg = (text or "").partition(": ")
        return errors.ConfigError(field or "experiment", msg or text or "invalid")
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.NotFoundError(text)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.AuthError(text)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return errors.UnavailableError(f"coordinator at {target} is unreachable ({text})")
    return errors.GossamerError(f"{code.name if code else 'error'}: {text}")
