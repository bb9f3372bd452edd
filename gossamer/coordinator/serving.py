"""The coordinator's side of security: its interceptors (rate limit, token) from its config."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from gossamer.security.limits import RateLimitInterceptor
from gossamer.security.token import TokenAuthInterceptor, load_token

if TYPE_CHECKING:
    from gossamer.coordinator.config import CoordinatorConfig

log = logging.getLogger(__name__)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def server_interceptors(config: CoordinatorConfig) -> list[grpc.aio.ServerInterceptor]:
    """Rate limit first, so guessed tokens are held to the same rate; then the token check."""
    out: list[grpc.aio.ServerInterceptor] = []
    if config.rate_limit:
        out.append(RateLimitInterceptor(config.rate_limit, config.rate_burst))
    if config.token_file:
        out.append(TokenAuthInterceptor(load_token(config.token_file)))
    return out


def reachable_from_others(host: str) -> bool:
    """Whether a server bound to `host` can be reached from other machines."""
    return host not in _LOOPBACK and not host.startswith("127.")


def warn_if_open(what: str, host: str, config: CoordinatorConfig, *, tls_applies: bool = True,
                 guarded: bool | None = None) -> bool:
    """Warn loudly when `what`, bound to `host`, is reachable from other hosts with neither a token
    (`guarded`; default: whether the join token is set) nor mutual TLS (that covers `what` when
    `tls_applies`); True when it warned."""
    tls = config.tls if tls_applies else None
    guarded = bool(config.token_file) if guarded is None else guarded
    if not reachable_from_others(host) or guarded or (tls is not None and tls.mutual):
        return False
    log.warning("%s\nUNPROTECTED: the coordinator's %s is bound to %s with neither a token nor mutual TLS: "
                "anyone who can reach it can join nodes, read every experiment and submit code that runs on "
                "the workers and (import check) on this host. Use --secure DIR, or --token-file with "
                "--tls-cert/--tls-key/--tls-ca (docs/security.md).\n%s", "!" * 78, what, host, "!" * 78)
    return True


def describe_security(config: CoordinatorConfig) -> str:
    """One line for the start-up log; warns when an open port is neither encrypted nor authenticated."""
    tls = config.tls
    if not warn_if_open("gRPC port", config.host, config) and tls is None and reachable_from_others(config.host):
        log.warning("serving plaintext on %s: anyone who can reach the port can read control-plane traffic "
                    "(see docs/security.md: --secure DIR)", config.host)
    return ", ".join(["mutual TLS" if tls and tls.mutual else "TLS" if tls else "plaintext",
                      "token required" if config.token_file else "no token"])


def secure_setup(directory: str, sans: list[str], host: str) -> tuple[dict[str, str], bool]:
    """`coordinator serve --secure DIR`: create DIR's CA, certificates and token unless present.

    Returns the server's paths (tls_cert, tls_key, tls_ca, token_file) and whether DIR was
    created just now.
    """
    from gossamer.security import certs

    names = [*sans, *([] if host in ("0.0.0.0", "::", "") else [host])]
    made = certs.init_secure_dir(directory, names)
    root = made.root
    paths = {"tls_cert": str(root / certs.SERVER_CERT), "tls_key": str(root / certs.SERVER_KEY),
             "tls_ca": str(root / certs.CA_CERT), "token_file": str(root / certs.TOKEN)}
    return paths, made.created


def client_instructions(directory: str, address: str) -> list[str]:
    """What to tell the operator after a secure set-up: what to copy, and the flags to use."""
    from gossamer.security import certs

    client = Path(directory).expanduser().resolve() / certs.CLIENT_DIR
    return [
        f"secure set-up in {client.parent}: mutual TLS and a join token.",
        f"Copy {client} to each worker machine and user (it holds a client certificate, the CA and the token;",
        "never copy ca.key or server.key), then:",
        f"  gossamer worker join {address} --secure {client}",
        f"  gossamer submit FILE --coordinator {address} --secure {client}",
        f"or, flag by flag: --tls-ca {client / certs.CA_CERT} --tls-cert {client / certs.CLIENT_CERT} "
        f"--tls-key {client / certs.CLIENT_KEY} --token-file {client / certs.TOKEN}",
        f"Python: Client.secured('{address}', ChannelSecurity.from_flags(secure='{client}'))",
    ]
