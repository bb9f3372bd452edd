"""The one small error hierarchy of gossamer; `gossamer.core.rpc_errors` maps it to gRPC codes."""

from __future__ import annotations


class GossamerError(Exception):
    """Base class of every error gossamer raises on purpose."""


class ConfigError(GossamerError, ValueError):
    """A configuration (Experiment, server flags, TOML file) is invalid.

    `field` names the offending field so clients can point at it.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class NotFoundError(GossamerError):
    """A named object (experiment, node, checkpoint) does not exist."""


class UnavailableError(GossamerError):
    """A peer (coordinator, shard) cannot be reached or did not answer in time."""


class NotLeaderError(UnavailableError):
    """This coordinator stands by (or lost its lead): another one, at `leader` (empty: not known), leads."""

    def __init__(self, leader: str) -> None:
        self.leader = leader
        super().__init__(f"not leader; the leader is at {leader}" if leader else "not leader; which coordinator leads is not known here")


class ProtocolError(GossamerError):
    """A message on the wire is malformed, oversized or inconsistent with the shard plan."""


class ShardError(GossamerError):
    """A parameter-server shard answered a request with an error reply.

    `codes` holds the shards' error codes (e.g. ``{"REFORM"}``) so callers can react to them.
    """

    def __init__(self, message: str, codes: frozenset[str] | set[str] = frozenset()) -> None:
        super().__init__(message)
        self.codes = frozenset(codes)


class CheckpointError(GossamerError):
    """A checkpoint is missing, partial or fails its checksum."""


class MissingExtraError(GossamerError):
    """A verb or path needs a package that only an optional extra of gossamer installs.

    The core install (a coordinator, a node, the user's own training) needs no extra; the
    message names the package and the `pip install` line that brings it.
    """

    def __init__(self, package: str, extra: str, needed_for: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(f"{needed_for} needs {package}, which the core install leaves out: "
                         f"pip install 'gossamer[{extra}]'")


class AuthError(GossamerError):
    """Credentials (token, certificate, CurveZMQ key) are missing or wrong."""
