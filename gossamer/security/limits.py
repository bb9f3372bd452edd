"""Per-peer request rate limit for grpc.aio servers (a token bucket per client address)."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]
_MAX_PEERS = 4096


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: 'ipv4:10.0.0.1:5000' -> '10.0.0.1', 'ipv6:[::1]:5' -> '::1'."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rsplit(":", 1)[0]
        return host.strip("[]")
    return peer  # unix sockets and the like: the whole string


class PeerBuckets:
    """A token bucket per key: `rate` requests/s sustained, `burst` at once.

    Idle buckets are forgotten once more than `max_peers` are tracked (a full bucket holds
    no information), so a flood of source addresses cannot grow memory without bound.
    """

    def __init__(self, rate: float, burst: float, max_peers: int = _MAX_PEERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_peers = max_peers
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)

    def allow(self, key: str) -> bool:
        """Take one token from `key`'s bucket; False when it is empty."""
        now = self._clock()
        tokens, last = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_peers:
            self._forget_idle(now)
        return ok

    def _forget_idle(self, now: float) -> None:
        refill_s = self.burst / self.rate
        for key, (_, last) in list(self._buckets.items()):
            if now - last >= refill_s:
                del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


def wrap_handler(handler: grpc.RpcMethodHandler,
                 check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]) -> grpc.RpcMethodHandler:
    """The same handler with `await check(context)` run before its behaviour (check may abort)."""
    ser, deser = handler.response_serializer, handler.request_deserializer
    if handler.response_streaming:
        behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
        if inspect.isasyncgenfunction(behavior):
            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                async for item in behavior(request, context):
                    yield item
            wrapped: Any = streaming
        else:  # a coroutine that writes with context.write (the health service's Watch)
            async def writing(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                return await behavior(request, context)
            wrapped = writing
        make = grpc.stream_stream_rpc_method_handler if handler.request_streaming \
            else grpc.unary_stream_rpc_method_handler
        return make(wrapped, deser, ser)
    unary = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def single(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        result = unary(request, context)
        return await result if inspect.isawaitable(result) else result

    make_unary = grpc.stream_unary_rpc_method_handler if handler.request_streaming \
        else grpc.unary_unary_rpc_method_handler
    return make_unary(single, deser, ser)


class RateLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls beyond `rate`/s (bursts of `burst`) from one client host with RESOURCE_EXHAUSTED.

    Keyed by the peer's IP address, not its port, so reconnecting does not reset a bucket.
    A stream counts once, when it opens. Installed before the token check, so guessing
    tokens is held to the same rate.
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.buckets = PeerBuckets(rate, burst)
        self.refused = 0
        self._last_log = 0.0

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        host = peer_host(context.peer() or "")
        if self.buckets.allow(host):
            return
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log > 5.0:  # one line per 5 s, whatever the flood
            self._last_log = now
            log.warning("rate limit: refusing calls from %s (%d refused so far)", host, self.refused)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"rate limit: more than {self.buckets.rate:g} requests/s (burst {self.buckets.burst:g}) "
            f"from {host}; slow down and retry",
        )

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return wrap_handler(handler, self._check)
