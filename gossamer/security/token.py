"""The join token (loading it, the server interceptor that checks it on every call) and the viewer token derived from it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from gossamer.core.errors import ConfigError

log = logging.getLogger(__name__)

#: Methods served without a token: the standard health service, so load balancers and
#: Kubernetes probes can check liveness. It reveals nothing but "serving".
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSED = "missing or wrong token"
_MIN_LENGTH = 16


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


#: The HMAC message a viewer token is derived under: a fixed label, so the derivation is the same on every
#: coordinator that holds the join token (standbys included) and on nothing else.
_VIEWER_LABEL = b"gossamer/http-viewer-token/v1"


def derive_viewer_token(join_token: str) -> str:
    """The viewer token of a cluster whose join token is `join_token`: HMAC-SHA256(join, label), URL-safe.

    It opens the coordinator's read-only HTTP side (status page, /api, /metrics) and nothing else;
    HMAC is one-way, so holding it tells nothing of the join token that joins nodes and submits code.
    """
    digest = hmac.new(join_token.encode(), _VIEWER_LABEL, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def check_token(token: str, field: str = "token") -> str:
    """Return `token` if it can travel as gRPC metadata; ConfigError naming `field` otherwise."""
    if not token:
        raise ConfigError(field, "the token is empty")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ConfigError(field, "the token must be printable ASCII without spaces")
    if len(token) < _MIN_LENGTH:
        log.warning("%s: the token has only %d characters; use at least %d (gossamer security init makes one)",
                    field, len(token), _MIN_LENGTH)
    return token


def load_token(path: str | os.PathLike[str], field: str = "token_file") -> str:
    """Read a token file: one secret line (surrounding whitespace ignored).

    Raises:
        ConfigError: naming `field`, when the file is missing, unreadable, empty or holds
            more than one line.
    """
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"cannot read token file {str(p)!r}: {e}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("token file %s is readable by other users; chmod 600 it", p)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ConfigError(field, f"token file {str(p)!r} is empty")
    if len(lines) > 1:
        raise ConfigError(field, f"token file {str(p)!r} must hold one line, found {len(lines)}")
    return check_token(lines[0], field)


def bearer(token: str) -> tuple[str, str]:
    """The metadata pair that carries `token`."""
    return ("authorization", f"Bearer {token}")


def _presented(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, credential = str(value).partition(" ")
            return credential.strip() if scheme.lower() == "bearer" else None
    return None


def _aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call with `code`."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)
        yield  # an async generator, as a streaming handler must be

    ser, deser = handler.response_serializer, handler.request_deserializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, deser, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, deser, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, deser, ser)
    return grpc.unary_unary_rpc_method_handler(refuse, deser, ser)


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call (but the health service) without `authorization: Bearer <token>`.

    The comparison is constant-time (`hmac.compare_digest`), so response timing does not
    leak how much of a guess was right. A refused call gets UNAUTHENTICATED, "missing or
    wrong token", and is logged with its method (never the presented value).
    """

    def __init__(self, token: str) -> None:
        self._token = check_token(token).encode()
        self.refused = 0

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        presented = _presented(handler_call_details.invocation_metadata)
        if presented is not None and hmac.compare_digest(presented.encode(), self._token):
            return handler
        self.refused += 1
        log.warning("refused %s: %s token", method, "wrong" if presented else "missing")
        return _aborting(handler, grpc.StatusCode.UNAUTHENTICATED, REFUSED)
