"""The one place that maps gossamer errors to gRPC status codes (server) and back (client)."""

from __future__ import annotations

import grpc

from gossamer import errors

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


def from_rpc_error(err: grpc.RpcError, target: str) -> errors.GossamerError:
    """Turn a client-side RpcError into the matching gossamer error with a one-line message."""
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, msg = (detail or "").partition(": ")
        return errors.ConfigError(field or "experiment", msg or detail or "invalid")
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.NotFoundError(detail)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.AuthError(detail)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return errors.UnavailableError(f"coordinator at {target} is unreachable ({detail})")
    return errors.GossamerError(f"{code.name if code else 'error'}: {detail}")
