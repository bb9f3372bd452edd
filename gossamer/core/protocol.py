"""Typed contracts between gossamer's processes: role specs, assignment updates, data-plane op metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gossamer.core.errors import ProtocolError

# Each contract is a frozen dataclass, validated where it is decoded (`from_*` raises
# ProtocolError or ConfigError naming the field), so no process reads another's bare dict keys.

# ---------------------------------------------------------------------------------------
# Node agent -> role processes (RoleSpec, AssignmentUpdate)
# ---------------------------------------------------------------------------------------

# Both cross a spawn (pickled) and, for the local ranks of a torchrun/srun launch, the attach
# socket (msgpack): `to_dict` gives plain values, `from_dict` checks every field's type.

_SCALARS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}


def _check(name: str, value: Any, kind: str) -> Any:
    """`value` of field `name` if it has the declared `kind`, else ProtocolError naming the field."""
    ok: bool
    if kind in _SCALARS:
        ok = isinstance(value, _SCALARS[kind]) and not (kind in ("int", "float") and isinstance(value, bool))
    elif kind == "dict[int, str]":
        ok = isinstance(value, dict) and all(isinstance(k, int) and isinstance(v, str) for k, v in value.items())
    elif kind == "dict[int, int]":
        ok = isinstance(value, dict) and all(isinstance(k, int) and isinstance(v, int) for k, v in value.items())
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
    #: Shard index -> its fencing epoch (grows at each promotion or restore of the shard).
    shard_epochs: dict[int, int] = field(default_factory=dict)
    #: Worker: the proof of its sender id it sends with every data-plane request.
    sender_token: str = ""
    #: Shard: the key the senders' tokens are checked with ("": senders are not checked).
    sender_key: str = ""
    #: CURVE: sender id -> the public key of the node that alone may speak as it.
    curve_senders: dict[str, str] = field(default_factory=dict)
    #: Restoring shard: checkpoint file server endpoint -> fetch token, of the nodes holding its files.
    checkpoint_sources: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> AssignmentUpdate:
        """Raises:
        ProtocolError: not a map, an unknown field, or a field of the wrong type (named).
        """
        return cls(**_decode(cls, raw, "update"))


#: A shard's report while it waits for its workers' copies (it lost every replica and found no checkpoint).
RESTORE_SEEDING = "(seeding: waiting for the workers' copies)"
#: A shard's report when it found nothing to restore from.
RESTORE_NONE = "(none: initial values)"


@dataclass(frozen=True, kw_only=True)
class LeaseRenewal:
    """Node agent -> shard process: the node's lease is renewed until `until` (time.monotonic, host-wide).

    Past it the shard stops acknowledging: the coordinator may promote its backup soon after.
    `until` 0: the agent is gone or the coordinator no longer knows this node (fenced for good).
    """

    until: float


@dataclass(frozen=True, kw_only=True)
class ShardStop:
    """Node agent -> shard process: stop (a SIGTERM follows). A SIGTERM without it came from outside
    (the machine or the batch job stopping, which reaches the agent too): the shard serves on until this.

    `checkpoint_s` > 0: the node leaves gracefully and no backup of this shard is assigned. The
    shard stops acknowledging, writes its state as the newest checkpoint and registers it within
    that many seconds, then exits; only then does the agent leave, so the restore the coordinator
    places elsewhere takes that checkpoint and loses nothing acknowledged.
    """

    checkpoint_s: float = 0.0


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
    #: A shard: time.monotonic() until which the node's lease holds (0: no lease kept); renewed by `LeaseRenewal`.
    lease_until: float = 0.0
    #: The file this process logs to besides stderr, its last traceback beside it ("": none), which the
    #: node's agent serves to `gossamer logs`.
    log_file: str = ""
    #: The experiment's shipped code directory as unpacked on this node ("": none), first on `sys.path`.
    workdir: str = ""

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

# The header's `meta` map of each op, by who sends it. Every request's meta also carries the
# request id "rid" (any msgpack scalar, echoed in the reply) next to these fields; the `to_meta`
# key order is the order the fields went on the wire before they were typed.


def chunk_key(index: int) -> str:
    """The tensor name chunk `index` travels under."""
    return f"c{index}"


def parse_chunk_key(name: str) -> int:
    """Inverse of `chunk_key`; raises ProtocolError for any other name."""
    if len(name) < 2 or name[0] != "c" or not name[1:].isdigit() or len(name) > 12:
        raise ProtocolError(f"tensor name {name!r} is not a chunk key like 'c12'")
    return int(name[1:])


def _int(op: str, meta: Mapping[str, Any], key: str, minimum: int = 0, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ProtocolError(f"{op} meta {key!r} must be an int >= {minimum}, got {value!r}")
    return value


def _codec_spec(op: str, meta: Mapping[str, Any], key: str) -> str:
    spec = meta.get(key, "none")
    if not isinstance(spec, str) or len(spec) > 64:
        raise ProtocolError(f"{op} meta {key!r} must be a codec spec string")
    return spec


@dataclass(frozen=True, kw_only=True)
class HelloMeta:
    """HELLO (worker -> shard): register as an active worker."""

    #: A new process under this sender id: its clocks start over.
    fresh: bool = False

    def to_meta(self) -> dict[str, Any]:
        return {"fresh": self.fresh}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> HelloMeta:
        fresh = meta.get("fresh", False)
        if not isinstance(fresh, bool):
            raise ProtocolError(f"HELLO meta 'fresh' must be a bool, got {fresh!r}")
        return cls(fresh=fresh)


@dataclass(frozen=True, kw_only=True)
class WelcomeMeta:
    """WELCOME (shard -> worker): the answer to HELLO."""

    done: bool
    #: The shard plan's fingerprint.
    plan: str

    def to_meta(self) -> dict[str, Any]:
        return {"done": self.done, "plan": self.plan}


@dataclass(frozen=True, kw_only=True)
class PullMeta:
    """PULL (worker -> shard): the current values of `chunks` (None: every chunk of the shard)."""

    chunks: tuple[int, ...] | None = None
    #: Codec of the parameter differences the shard sends back ("none": full values).
    pull_codec: str = "none"

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self.chunks is not None:
            meta["chunks"] = list(self.chunks)
        meta["pull_codec"] = self.pull_codec
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> PullMeta:
        chunks = meta.get("chunks")
        if chunks is not None and (
            not isinstance(chunks, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in chunks)
        ):
            raise ProtocolError("PULL meta 'chunks' must be a list of ints")
        return cls(chunks=None if chunks is None else tuple(chunks), pull_codec=_codec_spec("PULL", meta, "pull_codec"))


@dataclass(frozen=True, kw_only=True)
class PushMeta:
    """PUSH (worker -> shard): one local rank's part of a worker's update.

    `step`, `num_workers` and `generation` are sent (and read) only for a shard with a barrier.
    `values` False (meta "reply": "ack"): the PARAMS answer carries no values, only the version and
    the end flag; the worker pulls the new values after, a part at a time. A shard that does not
    know the key answers with the values, as before.

    `part` and `more` (a barrier only): a connection's large dense update sent in parts, one at a
    time (`paramserver.client.SYNC_PUSH_PART_BYTES`). `part` numbers them from 0; `more` says another
    follows: the shard adds the part into the step's sum and acknowledges it at once (an ack), so
    the next may come; the last part's answer waits for the step as a whole push's does.

    `more` without a barrier: a connection's large dense update sent as fragments back to back
    (`push_parts.fragments`), each but the last saying more follow. The shard gathers them as the
    parts of one update (its credit held until the last), applies the update once it has every
    chunk, and answers each fragment with the values of its chunks as soon as they are stepped.
    """

    #: The worker's update counter; a shard applies each clock of a worker once.
    clock: int
    #: The shard version the gradients were computed on.
    basis: int
    pull_codec: str = "none"
    step: int | None = None
    num_workers: int | None = None
    generation: int | None = None
    values: bool = True
    part: int | None = None
    more: bool = False
    #: A barrier only: the sender is done (a train function's sync, `ShardConfig.reduce`): it holds the barrier's
    #: place for the workers still stepping, its gradient left out of the mean. A round of idle pushes alone makes
    #: no version: every worker is done.
    idle: bool = False

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"clock": self.clock, "basis": self.basis}
        if self.pull_codec != "none":
            meta["pull_codec"] = self.pull_codec
        if not self.values:
            meta["reply"] = "ack"
        if self.step is None and self.more:
            meta["more"] = True
        if self.step is not None:
            meta["step"] = self.step
            meta["num_workers"] = self.num_workers if self.num_workers is not None else 1
            meta["generation"] = self.generation or 0
            if self.part is not None:
                meta["part"] = self.part
                if self.more:
                    meta["more"] = True
            if self.idle:
                meta["idle"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], *, barrier: bool) -> PushMeta:
        """Validate a PUSH's meta; `barrier`: the shard waits for every worker each step."""
        pull_codec = _codec_spec("PUSH", meta, "pull_codec")
        clock = _int("PUSH", meta, "clock")
        basis = _int("PUSH", meta, "basis")
        reply = meta.get("reply", "values")
        if reply not in ("values", "ack"):
            raise ProtocolError(f"PUSH meta 'reply' must be 'values' or 'ack', got {reply!r}")
        values = reply == "values"
        if not barrier:
            if "part" in meta:
                raise ProtocolError("PUSH meta 'part' is for a shard with a barrier (sync steps)")
            more = meta.get("more", False)
            if not isinstance(more, bool):
                raise ProtocolError(f"PUSH meta 'more' must be a bool, got {more!r}")
            return cls(clock=clock, basis=basis, pull_codec=pull_codec, values=values, more=more)
        part = None if meta.get("part") is None else _int("PUSH", meta, "part")
        more = meta.get("more", False)
        if not isinstance(more, bool) or (more and part is None):
            raise ProtocolError(f"PUSH meta 'more' must be a bool, and true only with 'part'; got {more!r}")
        idle = meta.get("idle", False)
        if not isinstance(idle, bool):
            raise ProtocolError(f"PUSH meta 'idle' must be a bool, got {idle!r}")
        return cls(clock=clock, basis=basis, pull_codec=pull_codec, step=_int("PUSH", meta, "step"),
                   num_workers=_int("PUSH", meta, "num_workers", 1), generation=_int("PUSH", meta, "generation",
                                                                                     default=0), values=values,
                   part=part, more=more, idle=idle)


@dataclass(frozen=True, kw_only=True)
class CreditMeta:
    """CREDIT (worker -> shard): may a push of `nbytes` be sent now? The shard answers GRANT (with the
    request's rid) when it may, and the push follows under that same rid (see `paramserver.push_credits`)."""

    nbytes: int

    def to_meta(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> CreditMeta:
        return cls(nbytes=_int("CREDIT", meta, "nbytes", 1))


@dataclass(frozen=True, kw_only=True)
class PushCompression:
    """The compressed form of a PUSH (its tensors are codec payloads, not raw chunks)."""

    #: Chunk index (as a string) -> that chunk's codec meta.
    chunks: dict[str, Any]
    #: The codec spec every chunk uses unless an override matches.
    codec: str
    #: (pattern, codec) pairs.
    overrides: tuple[tuple[str, str], ...] = ()

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"compression": self.chunks, "codec": self.codec}
        if self.overrides:
            meta["codec_overrides"] = [list(p) for p in self.overrides]
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> PushCompression | None:
        """None for an uncompressed PUSH."""
        if "compression" not in meta:
            return None
        chunks = meta["compression"]
        if not isinstance(chunks, dict) or not chunks:
            raise ProtocolError("PUSH meta 'compression' must map chunk index -> chunk meta")
        codec, overrides = meta.get("codec"), meta.get("codec_overrides", [])
        if not isinstance(codec, str) or not isinstance(overrides, list):
            raise ProtocolError("PUSH meta 'codec' must be a string and 'codec_overrides' a list")
        pairs: list[tuple[str, str]] = []
        for item in overrides:
            if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
                raise ProtocolError("PUSH meta 'codec_overrides' must hold [pattern, codec] pairs")
            pairs.append((item[0], item[1]))
        return cls(chunks=chunks, codec=codec, overrides=tuple(pairs))


@dataclass(frozen=True, kw_only=True)
class ParamsMeta:
    """PARAMS (shard -> worker): chunk values (or compressed differences), the answer to PULL and PUSH."""

    done: bool
    #: Versions applied between the push's basis and its own (async), or 0.
    staleness: int | None = None
    #: How far the pusher's clock leads the slowest worker's (async).
    lead: int | None = None
    #: Chunk index (as a string) -> codec meta of a compressed difference.
    pull_compression: dict[str, Any] | None = None
    codec: str | None = None
    #: Async: every worker's last applied clock in the state these values are of. A worker offers it with
    #: its copy (SEED), so a shard rebuilt from that copy counts exactly the updates it lacks.
    applied: dict[str, int] | None = None
    #: A train function's sync: the optimizer steps the workers had taken when they pushed the values these are
    #: (a worker that joins counts on from there).
    steps: int | None = None

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"done": self.done}
        if self.applied is not None:
            meta["applied"] = self.applied
        if self.steps is not None:
            meta["steps"] = self.steps
        if self.staleness is not None:
            meta["staleness"] = self.staleness
        if self.lead is not None:
            meta["lead"] = self.lead
        if self.pull_compression:
            meta["pull_compression"] = self.pull_compression
            meta["codec"] = self.codec
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> ParamsMeta:
        done = meta.get("done", False)
        if not isinstance(done, bool):
            raise ProtocolError(f"PARAMS meta 'done' must be a bool, got {done!r}")
        staleness = meta.get("staleness")
        if staleness is not None and (not isinstance(staleness, int) or isinstance(staleness, bool)):
            raise ProtocolError(f"PARAMS meta 'staleness' must be an int, got {staleness!r}")
        compressed = meta.get("pull_compression") or None
        if compressed is not None and not isinstance(compressed, dict):
            raise ProtocolError("PARAMS meta 'pull_compression' must map chunk index -> chunk meta")
        codec = meta.get("codec")
        steps = meta.get("steps")
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
            raise ProtocolError(f"PARAMS meta 'steps' must be an int >= 0, got {steps!r}")
        return cls(done=done, staleness=staleness, pull_compression=compressed,
                   codec=codec if isinstance(codec, str) else None, applied=clocks_of(meta, "PARAMS", "applied"),
                   steps=steps)


def clocks_of(meta: Mapping[str, Any], op: str, name: str) -> dict[str, int] | None:
    """`meta[name]`: worker -> clock (None when absent); raises ProtocolError naming `op` if malformed."""
    clocks = meta.get(name)
    if clocks is None:
        return None
    if not isinstance(clocks, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in clocks.items()):
        raise ProtocolError(f"{op} meta {name!r} must map worker -> int clock")
    return dict(clocks)


@dataclass(frozen=True, kw_only=True)
class ErrorMeta:
    """ERROR (any server -> its peer): why a request was refused; `code` is one of `transport.router`'s codes."""

    error: str
    code: str

    def to_meta(self) -> dict[str, Any]:
        return {"error": self.error, "code": self.code}


@dataclass(frozen=True, kw_only=True)
class Authority:
    """Who speaks, and for which epoch: the sender's token ("auth", on every worker request and on
    SYNC/REPLICATE) and the shard's fencing epoch ("epoch", on SYNC/REPLICATE and on every shard reply).

    Sits beside each op's own meta fields; a request without a token is refused by a shard that
    checks senders, a reply from an older epoch than the worker knows is ignored.
    """

    auth: str = ""
    epoch: int = 0

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"epoch": self.epoch}
        if self.auth:
            meta["auth"] = self.auth
        return meta

    @classmethod
    def from_meta(cls, op: str, meta: Mapping[str, Any]) -> Authority:
        auth = meta.get("auth", "")
        if not isinstance(auth, str) or len(auth) > 128:
            raise ProtocolError(f"{op} meta 'auth' must be a token string")
        return cls(auth=auth, epoch=_int(op, meta, "epoch", default=0))


@dataclass(frozen=True, kw_only=True)
class ReplicateMeta:
    """REPLICATE (primary -> backup): replay one applied update.

    Its gradient travels as tensors in one of two forms: dense (``c3``: the fp32 gradient the
    primary applied, `parts` empty), or encoded (`parts` non-empty: the compressed pushes the
    update was made of, part ``k``'s payload tensors named ``p{k}/<its PUSH tensor name>``),
    which the backup decodes and adds up in order as the primary did.
    """

    #: The lr factor the primary applied (staleness, schedule, linear scaling).
    lr_factor: float
    #: (worker, clock or step) of each worker update it covers.
    applied: tuple[tuple[str, int], ...] = ()
    #: Delayed Nesterov's N from this update on (asynchronous DiLoCo); 0: unchanged.
    delay: int = 0
    #: The compression of each forwarded push, in the order the primary added them up.
    parts: tuple[PushCompression, ...] = ()

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"lr_factor": self.lr_factor, "applied": [[s, k] for s, k in self.applied],
                                "delay": self.delay}
        if self.parts:
            meta["parts"] = [p.to_meta() for p in self.parts]
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> ReplicateMeta:
        factor = meta.get("lr_factor", 1.0)
        applied = meta.get("applied", [])
        delay = meta.get("delay", 0)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not isinstance(applied, list):
            raise ProtocolError("REPLICATE meta 'lr_factor' must be a number and 'applied' a list")
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < 1 << 31:
            raise ProtocolError("REPLICATE meta 'delay' must be an int in [0, 2**31)")
        # Entries that are not [worker, int] pairs carry nothing to remember: skipped.
        pairs = tuple((str(item[0]), item[1]) for item in applied
                      if isinstance(item, list) and len(item) == 2 and isinstance(item[1], int))
        return cls(lr_factor=float(factor), applied=pairs, delay=delay, parts=_replicate_parts(meta.get("parts", [])))


def _replicate_parts(raw: Any) -> tuple[PushCompression, ...]:
    if not isinstance(raw, list):
        raise ProtocolError("REPLICATE meta 'parts' must be a list of push compressions")
    parts: list[PushCompression] = []
    for k, item in enumerate(raw):
        try:
            part = PushCompression.from_meta(item) if isinstance(item, dict) else None
        except ProtocolError as e:
            raise ProtocolError(f"REPLICATE meta 'parts'[{k}]: {e}") from None
        if part is None:
            raise ProtocolError(f"REPLICATE meta 'parts'[{k}] must be a map with 'compression'")
        parts.append(part)
    return tuple(parts)


@dataclass(frozen=True, kw_only=True)
class SyncMeta:
    """SYNC (primary -> backup) and a shard's exported state: chunk values and optimizer state travel
    as tensors ("c3", "c3/momentum_buffer"), the rest here."""

    #: The shard version the state is at.
    state_version: int
    #: Worker -> the last clock (async) or step (sync) applied.
    applied: dict[str, int]
    #: "<chunk>/<name>" -> a scalar optimizer state entry (AdamW's step).
    scalars: dict[str, float]

    def to_meta(self) -> dict[str, Any]:
        return {"applied": dict(self.applied), "scalars": dict(self.scalars), "state_version": self.state_version}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SyncMeta:
        applied, scalars = meta.get("applied"), meta.get("scalars", {})
        if not isinstance(applied, dict) or not isinstance(scalars, dict):
            raise ProtocolError("state meta 'applied' and 'scalars' must be maps")
        version = meta.get("state_version", -1)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ProtocolError(f"SYNC meta 'state_version' must be an int, got {version!r}")
        try:
            return cls(state_version=version, applied={str(k): int(v) for k, v in applied.items()},
                       scalars={str(k): float(v) for k, v in scalars.items()})
        except (TypeError, ValueError, OverflowError) as e:
            raise ProtocolError(f"SYNC meta 'applied' and 'scalars' must hold numbers: {e}") from None


# -- gossip (push-sum peers) --------------------------------------------------------------


def _gossip_int(op: str, meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{op} meta {key!r} must be an int, got {value!r}")
    return value


def _gossip_ref(meta: Mapping[str, Any]) -> int | None:
    if "ref" not in meta:
        return None
    ref = _gossip_int("MASS", meta, "ref")
    if ref < -1:
        raise ProtocolError(f"MASS meta 'ref' must be -1 or a message id, got {ref}")
    return ref


def _number(op: str, meta: Mapping[str, Any], key: str) -> float:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{op} meta {key!r} must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class MassMeta:
    """MASS (peer -> neighbour): a share of the sender's push-sum mass (the codec payload travels as tensors).

    `from_meta` checks the types; whether the receiver takes the mass (its generation, codec,
    a weight in range) is the receiver's decision.
    """

    #: The sender's hold id: the ACK, NACK or CANCEL of this mass names it.
    id: int
    #: The sender's incarnation (a restarted peer's ids must not look seen).
    inc: int
    #: The membership generation the mass belongs to.
    gen: int
    step: int
    weight: float
    #: The value codec's spec (None: not a string, which no receiver's codec matches).
    codec: str | None
    #: The codec payload's meta (None: not a map).
    payload: dict[str, Any] | None
    #: None: the payload is the mass itself. Else the payload is a value ``v`` of z, the mass
    #: being ``weight * v``: with ``ref`` -1, ``v`` is the decoded payload; with ``ref`` = the
    #: id of an earlier MASS of this sender that the receiver applied, ``v`` is that message's
    #: value plus the decoded payload (a compressed difference, as CHOCO-SGD).
    ref: int | None = None

    def to_meta(self) -> dict[str, Any]:
        out = {"id": self.id, "inc": self.inc, "gen": self.gen, "step": self.step, "weight": self.weight,
               "codec": self.codec, "payload": self.payload}
        return out if self.ref is None else {**out, "ref": self.ref}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> MassMeta:
        codec, payload = meta.get("codec"), meta.get("payload")
        return cls(id=_gossip_int("MASS", meta, "id"), inc=_gossip_int("MASS", meta, "inc"),
                   gen=_gossip_int("MASS", meta, "gen"), step=_gossip_int("MASS", meta, "step"),
                   weight=_number("MASS", meta, "weight"), codec=codec if isinstance(codec, str) else None,
                   payload=payload if isinstance(payload, dict) else None,
                   ref=_gossip_ref(meta))


@dataclass(frozen=True, kw_only=True)
class CancelMeta:
    """CANCEL (peer -> neighbour): take back mass `id` unless it was applied (answered ACK, NACK or CANCELLED)."""

    id: int
    inc: int

    def to_meta(self) -> dict[str, Any]:
        return {"id": self.id, "inc": self.inc}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> CancelMeta:
        return cls(id=_gossip_int("CANCEL", meta, "id"), inc=_gossip_int("CANCEL", meta, "inc"))


@dataclass(frozen=True, kw_only=True)
class SnapMeta:
    """SNAP (peer -> peer): ask for the receiver's state; its "rid" (an int) is required."""

    #: Only weight, step and done, no parameters.
    light: bool = False
    #: The parameters as fp16 where they fit (half the bytes; for an evaluation, not for the final average).
    half: bool = False

    def to_meta(self) -> dict[str, Any]:
        return {"light": self.light, **({"half": True} if self.half else {})}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SnapMeta:
        _gossip_int("SNAP", meta, "rid")
        return cls(light=meta.get("light") is True, half=meta.get("half") is True)


@dataclass(frozen=True, kw_only=True)
class SnapshotMeta:
    """SNAPSHOT (peer -> peer): the answer to SNAP; its z (unless light) travels as tensor "z"."""

    weight: float
    step: int
    done: bool
    gen: int

    def to_meta(self) -> dict[str, Any]:
        return {"weight": self.weight, "step": self.step, "done": self.done, "gen": self.gen}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SnapshotMeta:
        weight = _number("SNAPSHOT", meta, "weight")
        if not (math.isfinite(weight) and weight > 0):
            raise ProtocolError(f"SNAPSHOT meta 'weight' must be finite and > 0, got {weight!r}")
        done = meta.get("done")
        if not isinstance(done, bool):
            raise ProtocolError(f"SNAPSHOT meta 'done' must be a bool, got {done!r}")
        gen = meta.get("gen", 0)
        return cls(weight=weight, step=_gossip_int("SNAPSHOT", meta, "step"), done=done,
                   gen=gen if isinstance(gen, int) and not isinstance(gen, bool) else 0)


def shard_lease_s(lease_timeout_s: float, heartbeat_interval_s: float) -> float:
    """How long after sending a heartbeat the coordinator answered a node's shards may acknowledge.

    The coordinator calls a node lost `lease_timeout_s` after it last *received* a heartbeat,
    which is after the node sent it; the node's shards stop (are fenced) `shard_lease_s` after
    it *sent* it. The margin (a heartbeat interval, at least a quarter of the lease) covers
    the clocks' rates and the pipe to the shard process, so an isolated primary has stopped
    acknowledging before its backup may be promoted.
    """
    return lease_timeout_s - max(heartbeat_interval_s, 0.25 * lease_timeout_s)
