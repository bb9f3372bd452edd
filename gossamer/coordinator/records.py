"""In-memory records of the coordinator's state (nodes, experiments, roles), persisted by `store.py`."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.core.modes import Mode, resolve
from gossamer.security.sender_tokens import new_key
from gossamer.transport.beat_wire import Signer
from gossamer.v1 import coordinator_pb2 as pb

ACTIVE_STATES = (
    pb.EXPERIMENT_STATE_QUEUED,
    pb.EXPERIMENT_STATE_STARTING,
    pb.EXPERIMENT_STATE_RUNNING,
)
FINISHED_STATES = (
    pb.EXPERIMENT_STATE_COMPLETED,
    pb.EXPERIMENT_STATE_FAILED,
    pb.EXPERIMENT_STATE_CANCELLED,
)
#: Cumulative per-source counters that are summed over sources for experiment totals.
COUNTERS = ("samples", "bytes_up", "bytes_down", "raw_bytes_up", "raw_bytes_down", "updates", "encode_s",
            "ps_decode_s", "versions_lost", "redone_steps", "resent", "ps_unreplicated", "ckpt_failed",
            "split_acks", "stale_replies", "shard_retries", "versions_regressed")
#: Counter prefixes summed over sources: updates not applied, by cause (see ShardServer).
COUNTER_PREFIXES = ("discarded_",)
#: Rates summed over sources.
RATES = ("samples_per_s",)
#: Experiment fields' defaults: a spec stored before a field existed reads as that default.
_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Experiment) if f.default is not dataclasses.MISSING}


_NODE_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,63}")


def check_node_id(node_id: str) -> str:
    """`node_id` as a node may propose it in Join (letters, digits, `_.-`, at most 64), or ConfigError."""
    if not _NODE_ID.fullmatch(node_id):
        raise ConfigError("node_id", f"must be 1 to 64 letters, digits, '_', '.' or '-', got {node_id[:80]!r}")
    return node_id


class BeatKey:
    """A node's key for UDP heartbeats (transport/beat_wire.py) and what checking its beats needs; never stored or shown.

    Issued with a fresh key at every Join (and to a known node without one at a gRPC heartbeat):
    a restarted or newly leading coordinator holds none, so beats under an older key are dropped
    until the node is keyed again over gRPC.
    """

    __slots__ = ("checks", "counter", "key", "signer", "window_at")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.signer = Signer(key)
        self.counter = 0  # the highest counter accepted: a beat must exceed it
        self.window_at = 0.0  # MAC checks are budgeted per window (UdpBeats)
        self.checks = 0

    @classmethod
    def fresh(cls) -> BeatKey:
        return cls(secrets.token_bytes(32))

    def __repr__(self) -> str:
        return "BeatKey(<secret>)"


@dataclass
class NodeRec:
    id: str
    name: str
    address: str
    hostname: str = ""
    spot: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    cpus: int = 0
    gpus: int = 0
    nproc_per_node: int = 1
    state: pb.NodeState.ValueType = pb.NODE_STATE_READY
    joined_unix: float = 0.0
    last_seen: float = 0.0
    experiment_id: str = ""
    stream_lost_at: float = 0.0  # when its assignment stream dropped (fast failure detection)
    curve_key: str = ""  # public CURVE key (z85) the node joined with; "" without CURVE
    #: Its checkpoint file server ("" none), the secret fetch tokens are made with, its CURVE key.
    checkpoint_endpoint: str = ""
    checkpoint_secret: str = ""
    checkpoint_key: str = ""
    #: Its UDP heartbeat key (None: none issued by this coordinator); not persisted, not in repr.
    beat: BeatKey | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "beat"})

    @classmethod
    def from_join(cls, req: pb.JoinRequest, node_id: str, now: float, curve_key: str) -> NodeRec:
        """A node that just joined, as its JoinRequest describes it."""
        files = checkpoint_server(req)
        return cls(id=node_id, name=req.name or f"{req.hostname or 'node'}-{node_id[:6]}",
                   address=req.address or "127.0.0.1", hostname=req.hostname, spot=req.spot, labels=dict(req.labels),
                   cpus=req.cpus, gpus=req.gpus, nproc_per_node=max(1, req.nproc_per_node),
                   state=pb.NODE_STATE_READY, joined_unix=now, last_seen=now, curve_key=curve_key,
                   checkpoint_endpoint=files[0], checkpoint_secret=files[1], checkpoint_key=files[2])

    @classmethod
    def from_json(cls, text: str) -> NodeRec:
        return cls(**json.loads(text))

    @property
    def alive(self) -> bool:
        return self.state in (pb.NODE_STATE_READY, pb.NODE_STATE_BUSY)


@dataclass
class RoleRec:
    node_id: str
    role: pb.Role.ValueType
    index: int
    state: pb.RoleState.ValueType = pb.ROLE_STATE_UNSPECIFIED
    endpoint: str = ""
    message: str = ""
    replica: int = 0  # parameter server: 0 = primary, 1 = backup
    replicated: bool = False  # primary: its backup is attached and synced
    restore_epoch: int = 0
    version: int = 0


def discard_events(source: str, old: dict[str, float], new: dict[str, float]) -> list[tuple[str, str]]:
    """(kind, message) of the events a source's new counters call for: updates rolled back or not applied, by cause."""
    out = []
    lost = new.get("versions_lost", 0.0) - old.get("versions_lost", 0.0)
    if lost > 0:
        out.append(("lost-updates", f"{source}: {int(lost)} update(s) rolled back by a restore from checkpoint "
                                    f"(total {int(new['versions_lost'])})"))
    for k, v in new.items():
        if k.startswith("discarded_") and v > old.get(k, 0.0):
            out.append(("discard", f"{source}: {int(v - old.get(k, 0.0))} update(s) not applied, cause "
                                   f"{k.removeprefix('discarded_')} (total {int(v)})"))
    return out


# Every join and every reconcile reads each experiment's spec: parsing its JSON each time took
# 30-40 % of the coordinator's CPU in a join storm with 50 experiments (bench/coordinator_load.py).
# Bounded: one entry per distinct spec text, the oldest dropped past SPEC_CACHE.
SPEC_CACHE = 4096


@functools.lru_cache(maxsize=SPEC_CACHE)
def _parsed_spec(spec_json: str) -> dict[str, Any]:
    return {**_SPEC_DEFAULTS, **json.loads(spec_json)}


@functools.lru_cache(maxsize=SPEC_CACHE)
def _mode_of(spec_json: str) -> Mode:
    spec = _parsed_spec(spec_json)
    return resolve(spec["mode"], spec.get("outer_step", "sync"))  # "sync": Experiment's default


@dataclass
class ExpRec:
    id: str
    seq: int
    name: str
    spec_json: str
    state: pb.ExperimentState.ValueType = pb.EXPERIMENT_STATE_QUEUED
    created_unix: float = 0.0
    started_unix: float = 0.0
    finished_unix: float = 0.0
    message: str = ""
    generation: int = 0
    steps: int = 0
    checkpoint: str = ""
    lead_node: str = ""
    next_worker_index: int = 0
    final_metrics: dict[str, float] = field(default_factory=dict)
    shard_versions: dict[str, int] = field(default_factory=dict)  # highest version seen per shard
    failures: int = 0  # role processes that crashed (a budget against crash loops)
    #: Experiment field of user code (CODE_FIELDS) -> workers that failed by it (failover.gives_up_on_user_code).
    user_failures: dict[str, int] = field(default_factory=dict)
    restore_epoch: int = 0
    starting_unix: float = 0.0  # when it entered STARTING (its start deadline counts from there)
    waiting_unix: float = 0.0  # running, left without nodes since then (0: not waiting)
    progress_unix: float = 0.0  # when its step count last grew (or it began running)
    stalled: bool = False  # its status says it makes no progress
    latest: dict[str, dict[str, float]] = field(default_factory=dict)
    roles: list[RoleRec] = field(default_factory=list)
    #: Shard index (as text) -> fencing epoch: grows at each promotion or restore of the shard.
    shard_epochs: dict[str, int] = field(default_factory=dict)
    #: The data-plane key shards check workers' sender tokens with (a record stored without one gets one).
    sender_key: str = field(default_factory=new_key)
    #: Node id -> newest step of this experiment's shard checkpoints it registered (its disk holds them).
    checkpoint_holders: dict[str, int] = field(default_factory=dict)
    #: When the lead's Complete came (0: not yet): it completes once every worker's final counters are in.
    completing_unix: float = 0.0
    #: The workers ("node_id/index") whose final report (ROLE_STATE_DONE) the completion waits for.
    awaiting_final: list[str] = field(default_factory=list)
    #: Workers ("node_id/index") that ended (failed or lost) without their final report, the first
    #: `final_reports.NAMED` of them; `unreported` counts them all.
    ended_unreported: list[str] = field(default_factory=list)
    unreported: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ExpRec:
        data = json.loads(text)
        data["roles"] = [RoleRec(**r) for r in data.get("roles", [])]
        return cls(**data)

    def next_epoch(self, shard: int) -> int:
        """Fence shard `shard`'s replicas of the epoch before: a promotion or restore names the next one."""
        epoch = self.shard_epochs.get(str(shard), 0) + 1
        self.shard_epochs[str(shard)] = epoch
        return epoch

    @property
    def spec(self) -> dict[str, Any]:
        """The experiment's fields (defaults filled in): a copy, parsed once per spec."""
        return dict(_parsed_spec(self.spec_json))

    @property
    def mode(self) -> Mode:
        """The mode table's row the experiment runs by."""
        return _mode_of(self.spec_json)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def add_recovery(self, add: dict[str, float], now: float) -> tuple[float, int, str, dict[str, float]]:
        """Count coordinator-side recovery figures (counts add up; detect_s keeps last and max); the metric row."""
        cur = self.latest.setdefault("coordinator", {})
        for k, v in add.items():
            if k == "detect_s":
                cur["detect_s_last"] = v
                cur["detect_s_max"] = max(cur.get("detect_s_max", 0.0), v)
            else:
                cur[k] = cur.get(k, 0.0) + v
        cur["time_unix"] = now
        return now, self.steps, "coordinator", {k: v for k, v in cur.items() if k != "time_unix"}

    def merge_point(self, source: str, time_unix: float, step: int, values: dict[str, float]) -> list[tuple[str, str]]:
        """Fold one metric point into `latest` and `shard_versions`; the (kind, message) events it calls for."""
        merged = self.latest.setdefault(source, {})
        events: list[tuple[str, str]] = []
        if time_unix < merged.get("time_unix", 0.0):
            # A point that arrives late (a role's flush overtook its reporter thread) never
            # replaces a newer value of the same source.
            for k, v in values.items():
                merged.setdefault(k, v)
        else:
            events = discard_events(source, merged, values)
            merged.update(values)
            merged["time_unix"] = time_unix
        shard = source.rpartition("/ps")[2]
        if shard.isdigit():
            self.shard_versions[shard] = max(self.shard_versions.get(shard, 0), int(step))
        return events

    def roles_of(self, role: pb.Role.ValueType) -> list[RoleRec]:
        return sorted((r for r in self.roles if r.role == role), key=lambda r: r.index)

    def totals(self) -> dict[str, float]:
        """Experiment-wide metrics: counters and rates summed over sources, latest values, finals."""
        out: dict[str, float] = {"steps": float(self.steps)}
        newest_t = -1.0
        for values in self.latest.values():
            for k in COUNTERS + RATES:
                if k in values:
                    out[k] = out.get(k, 0.0) + values[k]
            for k, v in values.items():
                if k.startswith(COUNTER_PREFIXES):
                    out[k] = out.get(k, 0.0) + v
                elif k.startswith("profile_"):  # a profiled rank's step-time split, keyed by node
                    out[k] = v
            t = values.get("time_unix", 0.0)
            if t > newest_t and "loss" in values:
                newest_t = t
                out["loss"] = values["loss"]
            evals = [k for k in values if k.startswith("eval_") and k != "eval_step"]  # loss, accuracy, the user's
            if evals and values.get("eval_step", 0) >= out.get("eval_step", -1):
                for k in evals:
                    out[k] = values[k]
                out["eval_step"] = values.get("eval_step", 0)
        for k, v in self.latest.get("coordinator", {}).items():  # recovery figures, already totals
            if k != "time_unix":
                out[k] = v
        # The shards count lost updates as workers return; never fewer than the restore events said.
        if "versions_lost_min" in out:
            out["versions_lost"] = max(out.get("versions_lost", 0.0), out["versions_lost_min"])
        out.update(self.final_metrics)
        if out.get("bytes_up") and "raw_bytes_up" in out:
            out["compression_ratio"] = out["raw_bytes_up"] / out["bytes_up"]
        if out.get("updates"):
            out["bytes_up_per_step"] = out.get("bytes_up", 0.0) / out["updates"]
            out["bytes_down_per_step"] = out.get("bytes_down", 0.0) / out["updates"]
        if out.get("bytes_down") and "raw_bytes_down" in out:
            out["pull_compression_ratio"] = out["raw_bytes_down"] / out["bytes_down"]
        return out


def checkpoint_server(req: pb.JoinRequest) -> tuple[str, str, str]:
    """A joining node's checkpoint file server: (endpoint, secret, CURVE key), all "" unless endpoint and secret are sound."""
    endpoint, secret = req.checkpoint_endpoint, req.checkpoint_secret
    try:
        sound = endpoint.startswith("tcp://") and len(endpoint) <= 256 and 32 <= len(bytes.fromhex(secret)) <= 64
    except ValueError:
        sound = False
    if not sound:
        return "", "", ""
    return endpoint, secret, _checked_key(req.curve_public_key)


def _checked_key(key: str) -> str:
    """A node's public CURVE key if well formed, else "" (its checkpoint file server is then reached in plaintext)."""
    if not key:
        return ""
    from gossamer.core.errors import ConfigError
    from gossamer.security.curve import check_public_key

    try:
        return check_public_key(key)
    except ConfigError:
        return ""
