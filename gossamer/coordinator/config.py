"""Configuration of the coordinator server."""

from __future__ import annotations

from dataclasses import dataclass

from gossamer.core.errors import ConfigError
from gossamer.security.tls import TLSConfig
from gossamer.security.token import derive_viewer_token, load_token


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """`gossamer coordinator serve` flags (CLI > GOSSAMER_* env > defaults)."""

    host: str = "127.0.0.1"
    port: int = 7070
    state_dir: str = "./gossamer-state"
    #: Where the state lives: "" (SQLite in `state_dir`, one coordinator) or postgresql://... (several
    #: coordinators on one database, one of them leading: docs/ha.md). Checkpoints stay in `state_dir`.
    state: str = ""
    #: HOST:PORT other coordinators name when this one leads ("not leader; the leader is at ...");
    #: default: --host (the host name when it binds every interface) and the bound port.
    advertise: str = ""
    heartbeat_interval_s: float = 1.0
    #: UDP heartbeats (docs/scale.md "UDP heartbeats"): nodes renew their lease with one
    #: authenticated datagram instead of a gRPC call, falling back to gRPC when none is answered.
    udp_beats: bool = True
    #: Their UDP port on `host`; None: the gRPC port's number (a free one if that is taken), 0: a free one.
    beat_port: int | None = None
    lease_timeout_s: float = 10.0
    #: Verify at submit, in a subprocess, that the model and dataset paths import.
    check_imports: bool = True
    grace_s: float = 3.0
    #: After the lead's Complete, how long the run waits for the other workers' final counters
    #: (samples, steps, bytes) before it completes without them, saying whose are missing.
    final_report_timeout_s: float = 30.0
    #: TLS: the coordinator's certificate and key (PEM). Without them it serves plaintext.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Mutual TLS: every client must present a certificate signed by this CA.
    tls_ca: str | None = None
    #: Every call (but the health service) must carry `authorization: Bearer <the token in this file>`.
    token_file: str | None = None
    #: The HTTP side's read-only credential (status page, /api, /metrics), never accepted on gRPC, so it
    #: cannot join, submit or cancel. None: derived from the join token and written to STATE_DIR/viewer.token.
    viewer_token_file: str | None = None
    #: Largest request the server accepts; a bigger one gets RESOURCE_EXHAUSTED.
    max_message_bytes: int = 16 << 20
    #: Requests per second per client host (a token bucket); 0 turns the limit off.
    rate_limit: float = 200.0
    rate_burst: int = 400
    #: CurveZMQ on the data plane (shards, gossip): None means on exactly when serving TLS
    #: (docs/security.md, "Data plane").
    curve: bool | None = None
    #: Import checks (child processes running user code) at once; more wait (docs/security.md).
    import_check_concurrency: int = 2
    #: A check still running after this is killed and the submit queued unchecked (an event says so).
    import_check_timeout_s: float = 120.0
    #: Largest packed code directory (`submit --workdir`) an upload may be; a bigger one is refused naming its size.
    workdir_max_bytes: int = 64 << 20
    #: All stored code directories together at most (those of ended experiments dropped first).
    workdir_store_bytes: int = 1 << 30
    #: Metric points older than this are downsampled to one per source per `metrics_bucket_s`.
    metrics_retention_s: float = 6 * 3600.0
    metrics_bucket_s: float = 60.0
    #: Events older than this are deleted (0: kept for ever).
    event_retention_s: float = 14 * 86400.0
    #: Finished experiments (with their metrics, events, checkpoint records) deleted this long
    #: after they finished (0: kept for ever). The checkpoint files stay on disk.
    finished_retention_s: float = 7 * 86400.0
    #: Nodes lost or gone this long are forgotten (0: kept for ever).
    lost_node_retention_s: float = 86400.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        if self.beat_port is not None and not 0 <= self.beat_port <= 65535:
            raise ConfigError("beat_port", f"must be in 0..65535, got {self.beat_port}")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError("heartbeat_interval_s", "must be > 0")
        if self.lease_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError("lease_timeout_s", "must be greater than heartbeat_interval_s")
        if not 0 <= self.final_report_timeout_s < float("inf"):
            raise ConfigError("final_report_timeout_s", f"must be a number of seconds >= 0, got {self.final_report_timeout_s!r}")
        if not self.state_dir:
            raise ConfigError("state_dir", "must be a directory path")
        if self.state not in ("", "sqlite") and not self.state.startswith(("postgresql://", "postgres://")):
            raise ConfigError("state", f"expected sqlite (the default) or postgresql://USER@HOST:PORT/DB, "
                                       f"got {self.state.split('@')[-1]!r}")
        if self.advertise and ":" not in self.advertise:
            raise ConfigError("advertise", f"expected HOST:PORT, got {self.advertise!r}")
        if self.tls_ca and not self.tls_cert:
            raise ConfigError("tls_ca", "mutual TLS (--tls-ca) needs the server's --tls-cert and --tls-key too")
        self.tls  # noqa: B018 — validates the certificate paths now, not at the first connection
        join = load_token(self.token_file) if self.token_file else None
        if self.viewer_token_file and load_token(self.viewer_token_file, "viewer_token_file") == join:
            raise ConfigError("viewer_token_file", "holds the join token: a viewer token must be another secret, "
                                                   "since whoever holds the join token can join nodes and submit code")
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes", f"must be >= 1024, got {self.max_message_bytes}")
        if self.rate_limit < 0:
            raise ConfigError("rate_limit", "must be >= 0 (0: no limit)")
        if self.rate_limit and self.rate_burst < 1:
            raise ConfigError("rate_burst", "must be >= 1")
        if self.import_check_concurrency < 1:
            raise ConfigError("import_check_concurrency", f"must be >= 1, got {self.import_check_concurrency}")
        if not 0 < self.import_check_timeout_s < float("inf"):
            raise ConfigError("import_check_timeout_s", f"must be a number of seconds > 0, got {self.import_check_timeout_s}")
        if not 0 < self.workdir_max_bytes <= self.workdir_store_bytes:
            raise ConfigError("workdir_max_bytes", f"must be > 0 and at most workdir_store_bytes "
                                                   f"({self.workdir_store_bytes}), got {self.workdir_max_bytes}")
        if not self.metrics_bucket_s > 0:
            raise ConfigError("metrics_bucket_s", f"must be > 0, got {self.metrics_bucket_s}")
        for name in ("metrics_retention_s", "event_retention_s", "finished_retention_s", "lost_node_retention_s"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ConfigError(name, f"must be a number of seconds >= 0 (0: keep for ever), got {value}")

    @property
    def replicated(self) -> bool:
        """Whether the state is in PostgreSQL (several coordinators, one leading)."""
        return self.state.startswith(("postgresql://", "postgres://"))

    def viewer_token(self) -> str | None:
        """The HTTP side's viewer token: `viewer_token_file`'s, else derived from the join token; None: neither."""
        if self.viewer_token_file:
            return load_token(self.viewer_token_file, "viewer_token_file")
        if self.token_file:
            return derive_viewer_token(load_token(self.token_file))
        return None

    @property
    def data_plane_curve(self) -> bool:
        """Whether the data plane runs CurveZMQ (`curve`, defaulting to TLS on or off)."""
        return self.curve if self.curve is not None else self.tls is not None

    @property
    def tls(self) -> TLSConfig | None:
        """The server's TLS settings (None: plaintext)."""
        if not (self.tls_cert or self.tls_key):
            return None
        return TLSConfig(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca)
