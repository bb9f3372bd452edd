"""Client side of control-plane security: channels that carry TLS and the token, and clear errors."""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gossamer.core.errors import AuthError, ConfigError, GossamerError, UnavailableError
from gossamer.core.rpc_errors import from_rpc_error
from gossamer.security import certs
from gossamer.security.tls import TLSConfig
from gossamer.security.token import REFUSED, bearer, check_token, load_token

log = logging.getLogger(__name__)
_warned_plaintext: set[str] = set()


@dataclass(frozen=True, kw_only=True)
class ChannelSecurity:
    """How a client (worker, role process, CLI, `Client`) reaches a secured coordinator.

    `token` is the secret itself; `token_file` where it came from. Role processes get the
    file's path (never the secret on a command line) and read it themselves.
    """

    tls: TLSConfig | None = None
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None

    def __post_init__(self) -> None:
        if self.token_file and self.token is None:
            object.__setattr__(self, "token", load_token(self.token_file))
        elif self.token is not None:
            check_token(self.token)

    @classmethod
    def from_flags(cls, *, secure: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                   tls_key: str | None = None, tls_server_name: str | None = None,
                   token_file: str | None = None) -> ChannelSecurity | None:
        """From CLI flags; `secure` is a copy of a secure directory's `client/` (or the directory
        itself), and explicit flags override the files found in it. None when nothing is set."""
        if secure:
            found = client_files(secure)
            tls_ca = tls_ca or found.get("ca")
            tls_cert = tls_cert or found.get("cert")
            tls_key = tls_key or found.get("key")
            token_file = token_file or found.get("token")
        tls = None
        if tls_ca or tls_cert or tls_key or tls_server_name:
            tls = TLSConfig(ca=tls_ca, cert=tls_cert, key=tls_key, server_name=tls_server_name)
        if tls is None and not token_file:
            return None
        return cls(tls=tls, token_file=token_file)

    def spec(self) -> dict[str, Any]:
        """A picklable description for a spawned role process (paths; the token only if it has no file)."""
        return {
            "tls": None if self.tls is None else self.tls.spec(),
            "token_file": None if not self.token_file else str(Path(self.token_file).expanduser().resolve()),
            "token": None if self.token_file else self.token,
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | None) -> ChannelSecurity | None:
        if not spec:
            return None
        tls = TLSConfig(**spec["tls"]) if spec.get("tls") else None
        return cls(tls=tls, token=spec.get("token"), token_file=spec.get("token_file"))


def client_files(directory: str | os.PathLike[str]) -> dict[str, str]:
    """The CA, client certificate, key and token in a secure directory (or its `client/`)."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ConfigError("secure", f"no such directory: {str(root)!r} (gossamer security init creates one)")
    if (root / certs.CLIENT_DIR).is_dir():
        root = root / certs.CLIENT_DIR
    names = {"ca": certs.CA_CERT, "cert": certs.CLIENT_CERT, "key": certs.CLIENT_KEY, "token": certs.TOKEN}
    found = {k: str(root / f) for k, f in names.items() if (root / f).is_file()}
    if "ca" not in found and "token" not in found:
        raise ConfigError("secure", f"{str(root)!r} holds neither {certs.CA_CERT} nor {certs.TOKEN}")
    return found


# --- attaching the token ----------------------------------------------------------------------
# The token rides on interceptors over TLS too, never on a `grpc.metadata_call_credentials` plugin: gRPC calls
# and destroys such a plugin on its own threads, taking the GIL, and a server being destroyed in the same
# process holds the GIL while it waits for those threads (an AB-BA deadlock that froze a whole process).
class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                         grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call of a synchronous channel."""

    def __init__(self, token: str) -> None:
        self._pair = bearer(token)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._pair], d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)


def _aio_details(pair: tuple[str, str], d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(d.metadata or ()), pair)
    return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioBearerUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._pair = bearer(token)

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_aio_details(self._pair, client_call_details), request)


class _AioBearerUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._pair = bearer(token)

    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_aio_details(self._pair, client_call_details), request)


def _warn_plaintext_token(address: str) -> None:
    if address not in _warned_plaintext:
        _warned_plaintext.add(address)
        log.warning("sending the token to %s without TLS: anyone on the network path can read it "
                    "(use --tls-ca, or --secure DIR)", address)


def coordinator_addresses(address: str | Sequence[str]) -> list[str]:
    """The coordinators named by "a:1,b:2" (or a list of them), each HOST:PORT, in order."""
    parts = [address] if isinstance(address, str) else list(address)
    found = [a.strip() for part in parts for a in part.split(",") if a.strip()]
    if not found:
        raise ConfigError("coordinator", "no coordinator address given (HOST:PORT, or several: a:7070,b:7070)")
    return found


#: Several coordinators (one leads, docs/ha.md): route every call to the one whose health service
#: says SERVING (the leader; standbys say NOT_SERVING).
_FOLLOW_LEADER = json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}})
_LEADER_OPTIONS = (("grpc.service_config", _FOLLOW_LEADER),)
#: How soon a channel dials a coordinator that went away again: gRPC's default backoff grows to 120 s, so
#: a node whose coordinator was down for 25 s dialled next up to 17 s after it was back, past the one lease
#: a restarted coordinator gives every node to re-attach (5 s in tests), and was counted lost.
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000))


def _target(address: str | Sequence[str], security: ChannelSecurity | None) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target for `address` and the options it needs: one coordinator as given; several as
    one channel over their resolved IPs that follows the leader."""
    addresses = coordinator_addresses(address)
    if len(addresses) == 1:
        return addresses[0], list(RECONNECT_OPTIONS)
    resolved = []
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError("coordinator", f"expected HOST:PORT, got {a!r}")
        try:
            ip = socket.getaddrinfo(host.strip("[]"), int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except (OSError, IndexError):
            raise ConfigError("coordinator", f"cannot resolve {host!r} of {a!r}") from None
        resolved.append(f"{ip}:{port}")
    options: list[tuple[str, Any]] = [*_LEADER_OPTIONS, *RECONNECT_OPTIONS]
    if security is not None and security.tls is not None and not security.tls.server_name:
        # The certificates must name the first host (docs/ha.md): TLS checks the channel's authority.
        options.append(("grpc.default_authority", addresses[0].rpartition(":")[0].strip("[]")))
    return "ipv4:" + ",".join(resolved), options


def open_channel(address: str | Sequence[str], security: ChannelSecurity | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A synchronous channel to the coordinator (the leader of several) with TLS and the token as configured."""
    target, extra = _target(address, security)
    options = [*extra, *options]
    if security is not None and security.tls is not None:
        channel = grpc.secure_channel(target, security.tls.channel_credentials(),
                                      options=[*options, *security.tls.channel_options()])
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    if security is not None and security.token:
        if security.tls is None:
            _warn_plaintext_token(target)
        channel = grpc.intercept_channel(channel, _BearerInterceptor(security.token))
    return channel


def open_aio_channel(address: str | Sequence[str], security: ChannelSecurity | None = None,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to the coordinator (the leader of several) with TLS and the token as configured."""
    target, extra = _target(address, security)
    options = [*extra, *options]
    interceptors: list[Any] = []
    if security is not None and security.token:
        if security.tls is None:
            _warn_plaintext_token(target)
        interceptors = [_AioBearerUnaryUnary(security.token), _AioBearerUnaryStream(security.token)]
    if security is not None and security.tls is not None:
        return grpc.aio.secure_channel(target, security.tls.channel_credentials(),
                                       options=[*options, *security.tls.channel_options()],
                                       interceptors=interceptors or None)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors or None)


# --- clear errors -----------------------------------------------------------------------------
def probe(address: str, timeout: float = 2.0) -> str:
    """What speaks at `address`: "plaintext", "tls", "mtls" (TLS that drops a client without a
    certificate), or "unknown" (unreachable, or not a plain HOST:PORT)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return "unknown"
    host = host.strip("[]")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # only asks which protocol is spoken; nothing is trusted
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw:
            try:
                tls = ctx.wrap_socket(raw, server_hostname=None)
            except ssl.SSLError:
                return "plaintext"
            with tls:
                # An HTTP/2 server answers the preface with SETTINGS; an mTLS server hangs up.
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                try:
                    return "tls" if tls.recv(9) else "mtls"
                except (ssl.SSLError, ConnectionError):
                    return "mtls"
    except (OSError, ValueError):
        return "unknown"


def explain_rpc_error(err: grpc.RpcError, address: str, security: ChannelSecurity | None = None,
                      *, probe_timeout: float = 2.0) -> GossamerError:
    """The gossamer error for a failed call, saying what to change when security is the cause.

    Returns AuthError for a refused token or a TLS mismatch (a configuration problem that
    retrying will not fix), else what `from_rpc_error` makes of it.
    """
    code = err.code() if hasattr(err, "code") else None
    detail = (err.details() if hasattr(err, "details") else "") or ""
    tls = security.tls if security is not None else None
    has_token = security is not None and bool(security.token)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        hint = "check --token-file (env GOSSAMER_TOKEN_FILE)" if has_token else \
            "it requires one: pass --token-file FILE (env GOSSAMER_TOKEN_FILE) or Client(..., token=...)"
        return AuthError(f"coordinator at {address} refused the token (UNAUTHENTICATED: {detail or REFUSED}); {hint}")
    if code != grpc.StatusCode.UNAVAILABLE:
        return from_rpc_error(err, address)
    lowered = detail.lower()
    if tls is not None and "wrong_version_number" in lowered:
        return AuthError(f"coordinator at {address} does not speak TLS (plaintext): drop --tls-ca/--secure, "
                         "or start it with --tls-cert and --tls-key")
    if tls is not None and "certificate_verify_failed" in lowered:
        return AuthError(f"the certificate of the coordinator at {address} is not signed by the CA in --tls-ca "
                         f"({tls.ca or 'system roots'}); use the ca.crt the coordinator was set up with")
    if tls is not None and "hostname verification" in lowered:
        return AuthError(f"the certificate of the coordinator at {address} does not list that host name: "
                         "pass --tls-server-name NAME (a name it lists), or regenerate it with --san HOST")
    if "socket closed" in lowered or "handshake" in lowered or "ssl" in lowered:
        spoken = probe(address, probe_timeout)
        if tls is None and spoken in ("tls", "mtls"):
            return AuthError(f"coordinator at {address} speaks TLS and this client connected in plaintext: "
                             "pass --tls-ca CA.crt (or --secure DIR; Client(..., tls='ca.crt'))")
        if tls is not None and spoken == "mtls":
            if not tls.cert:
                return AuthError(f"coordinator at {address} requires a client certificate (mutual TLS): "
                                 "pass --tls-cert and --tls-key (or --secure DIR)")
            return AuthError(f"coordinator at {address} refused the client certificate {tls.cert!r} (mutual TLS): "
                             "it must be signed by the CA the coordinator trusts (--tls-ca on the coordinator)")
    return UnavailableError(f"coordinator at {address} is unreachable ({detail})")
