"""TLS and mutual TLS for the control plane: certificate paths in, gRPC credentials out."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gossamer.core.errors import ConfigError


def _read(path: str, field: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ConfigError(field, f"cannot read {path!r}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(field, f"{path!r} is not a PEM file")
    return data


@dataclass(frozen=True, kw_only=True)
class TLSConfig:
    """Certificate paths of one side of a TLS connection (PEM files).

    On the coordinator: `cert` and `key` are its certificate and key (required); `ca`, when
    given, turns on mutual TLS: every client must present a certificate signed by it.
    On a client (worker, CLI, Python `Client`): `ca` verifies the coordinator (None: the
    system's roots); `cert` and `key` are the client's certificate for mutual TLS.
    `server_name` overrides the name checked against the coordinator's certificate (when it
    is reached at an address its certificate does not list).
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("tls_cert" if self.key else "tls_key",
                              "--tls-cert and --tls-key go together (a certificate and its private key)")
        for field, path in (("tls_cert", self.cert), ("tls_key", self.key), ("tls_ca", self.ca)):
            if path is not None and not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(field, f"no such file: {path!r}")

    @property
    def mutual(self) -> bool:
        """On the server: client certificates are required."""
        return self.ca is not None

    def spec(self) -> dict[str, str | None]:
        """Absolute paths, to hand to a spawned process (which re-reads the files)."""
        def absolute(p: str | None) -> str | None:
            return None if p is None else str(Path(p).expanduser().resolve())

        return {"cert": absolute(self.cert), "key": absolute(self.key), "ca": absolute(self.ca),
                "server_name": self.server_name}

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials; with `ca`, client certificates are required and verified (mTLS)."""
        if not self.cert or not self.key:
            raise ConfigError("tls_cert", "a TLS coordinator needs --tls-cert and --tls-key")
        pair = (_read(self.key, "tls_key"), _read(self.cert, "tls_cert"))
        root = _read(self.ca, "tls_ca") if self.ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials: verify the server against `ca`; present `cert` when given (mTLS)."""
        root = _read(self.ca, "tls_ca") if self.ca else None
        key = _read(self.key, "tls_key") if self.key else None
        chain = _read(self.cert, "tls_cert") if self.cert else None
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
