"""Configuration of the coordinator server."""

from __future__ import annotations

from dataclasses import dataclass

from gossamer.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """`gossamer coordinator serve` flags (CLI > GOSSAMER_* env > defaults)."""

    host: str = "127.0.0.1"
    port: int = 7070
    state_dir: str = "./gossamer-state"
    heartbeat_interval_s: float = 1.0
    lease_timeout_s: float = 10.0
    #: Verify at submit, in a subprocess, that the model and dataset paths import.
    check_imports: bool = True
    grace_s: float = 3.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError("heartbeat_interval_s", "must be > 0")
        if self.lease_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError("lease_timeout_s", "must be greater than heartbeat_interval_s")
        if not self.state_dir:
            raise ConfigError("state_dir", "must be a directory path")
