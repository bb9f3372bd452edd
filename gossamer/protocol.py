"""Typed contracts between gossamer's processes: role specs, assignment updates, data-plane op metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gossamer.errors import ProtocolError

# Each contract is a frozen dataclass, validated where it is decoded (`from_*` raises
# ProtocolError or ConfigError naming the field), so no process reads another's bare dict keys.

# ---------------------------------------------------------------------------------------
# Node agent -> role processes (RoleSpec, AssignmentUpdate)
# ---------------------------------------------------------------------------------------

# Both cross a spawn (pickled) and, for the local ranks of a torchrun/srun launch, the attach
# socket (msgpack): `to_dict` gives plain values, `from_dict` checks every field's type.

_SCALARS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,)}


def _check(name: str, value: Any, kind: str) -> Any:
    """`value` of field `name` if it has the declared `kind`, else ProtocolError naming the field."""
    ok: bool
    if kind in _SCALARS:
        ok = isinstance(value, _SCALARS[kind]) and not (kind == "int" and isinstance(value, bool))
    elif kind == "dict[int, str]":
        ok = isinstance(value, dict) and all(isinstance(k, int) and isinstance(v, str) for k, v in value.items())
    elif kind == "dict[str, str]":
        ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    elif kind == "tuple[str, ...]":
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    elif kind == "dict[str, Any] | None":
        ok = value is None or (isinstance(value, dict) and all(isinstance(k, str) for k in value))
    else:  # pragma: no cover - a field of a type this decoder does not know
        raise TypeError(f"{name}: no decoder for {kind}")
    if not ok:
        raise ProtocolError(f"{name}: expected {kind}, got {type(value).__name__} {value!r:.80}")
    return value


def _decode(cls: Any, raw: Any, where: str) -> dict[str, Any]:
    """The keyword arguments of `cls` from a decoded map, every field checked."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    if unknown := sorted(set(raw) - set(known)):
        raise ProtocolError(f"{where}: unknown field(s) {unknown}")
    out: dict[str, Any] = {}
    for name, f in known.items():
        if name not in raw:
            continue  # the dataclass default, or its own TypeError for a required field
        out[name] = _check(f"{where}.{name}", raw[name], str(f.type))
    return out


@dataclass(frozen=True, kw_only=True)
class AssignmentUpdate:
    """What a running role process learns of its changed assignment (membership, promotion, endpoints)."""

    #: This worker evaluates and writes the final checkpoint.
    lead: bool = False
    num_workers: int = 1
    #: Shard index -> data-plane endpoint of its primary.
    endpoints: dict[int, str] = field(default_factory=dict)
    #: The experiment's membership generation (sync barriers re-form on a new one).
    generation: int = 0
    #: Position among the current workers (sync batch split).
    worker_rank: int = 0
    #: 0: primary shard, 1: its backup.
    replica: int = 0
    #: Where a primary shard replicates to ("" for none).
    backup_endpoint: str = ""
    #: Senders of the current workers (a shard's barrier membership).
    workers: tuple[str, ...] = ()
    #: Restore the shard from its newest good checkpoint when this grows.
    restore_epoch: int = 0
    #: Gossip: worker index -> endpoint of its peer.
    peers: dict[int, str] = field(default_factory=dict)
    #: CURVE: endpoint -> server public key, and the member public keys a shard admits.
    curve_server_keys: dict[str, str] = field(default_factory=dict)
    curve_members: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> AssignmentUpdate:
        """Raises:
        ProtocolError: not a map, an unknown field, or a field of the wrong type (named).
        """
        return cls(**_decode(cls, raw, "update"))


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """Everything a role process (a shard, or one local rank of a worker) is started with."""

    coordinator: str
    node_id: str
    #: The host this node's data-plane servers bind (and other nodes reach).
    address: str
    experiment_id: str
    #: The shard index, or the worker index.
    index: int
    experiment_json: str
    checkpoint_dir: str
    #: The node's name (logs, environment fingerprints, profiles).
    node_name: str = ""
    #: Intra-op threads of this process (GOSSAMER_THREADS overrides it).
    threads: int = 1
    #: The node agent's /metrics feed socket ("" when not served).
    metrics_socket: str = ""
    log_level: str = "INFO"
    log_format: str = "text"
    #: `ChannelSecurity.spec()` of the node's coordinator channel (None: plaintext).
    security: dict[str, Any] | None = None
    #: The node's CURVE key pair ("" when the data plane is plaintext).
    curve_public: str = ""
    curve_secret: str = ""
    #: Log label of the process ("ps0", "ps0b", "w1.0").
    label: str = "role"
    #: A worker's local rank, the number of them, and the port of their process group.
    local_rank: int = 0
    nproc: int = 1
    master_port: int = 0
    #: The assignment as it was when the process was started.
    assignment: AssignmentUpdate = field(default_factory=AssignmentUpdate)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> RoleSpec:
        """Raises:
        ProtocolError: not a map, an unknown or missing field, or a field of the wrong type (named).
        """
        if not isinstance(raw, dict):
            raise ProtocolError(f"spec: expected a map, got {type(raw).__name__}")
        plain = {k: v for k, v in raw.items() if k != "assignment"}
        kwargs = _decode(cls, plain, "spec")
        missing = [f.name for f in fields(cls) if f.name not in raw and f.name in _REQUIRED_SPEC]
        if missing:
            raise ProtocolError(f"spec: missing field(s) {missing}")
        return cls(**kwargs, assignment=AssignmentUpdate.from_dict(raw.get("assignment", {})))


_REQUIRED_SPEC = ("coordinator", "node_id", "address", "experiment_id", "index", "experiment_json",
                  "checkpoint_dir")


# ---------------------------------------------------------------------------------------
# Data plane: metadata of each op's header (PUSH, PULL, HELLO, ...)
# ---------------------------------------------------------------------------------------

# (section owned by the parameter-server refactor)
