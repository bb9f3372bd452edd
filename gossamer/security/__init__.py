"""Control-plane security: TLS / mutual TLS, the join token, and request limits for gRPC servers."""

from __future__ import annotations

from gossamer.security.channel import (
    ChannelSecurity,
    explain_rpc_error,
    open_aio_channel,
    open_channel,
    probe,
)
from gossamer.security.limits import PeerBuckets, RateLimitInterceptor
from gossamer.security.tls import TLSConfig
from gossamer.security.token import TokenAuthInterceptor, generate_token, load_token

__all__ = [
    "ChannelSecurity",
    "PeerBuckets",
    "RateLimitInterceptor",
    "TLSConfig",
    "TokenAuthInterceptor",
    "explain_rpc_error",
    "generate_token",
    "load_token",
    "open_aio_channel",
    "open_channel",
    "probe",
]
