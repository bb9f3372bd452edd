"""One parameter-server shard: a ZMQ ROUTER loop that validates pushes, applies them, replicates, replies.

Replication (primary/backup): a primary forwards every applied update (the dense gradient
it applied, the lr factor, and which worker clocks it covers) to its backup, which applies
the same optimizer step and so holds bit-identical state. A worker's PUSH is acknowledged
(its reply sent) only once the backup has acknowledged that version: an acknowledged update
survives the loss of either replica. A backup that does not answer for `backup_timeout_s`
is detached; the primary then acknowledges unreplicated (counted) until a new backup is
attached with a full-state SYNC.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq

from gossamer.checkpoint.sharded import ShardSnapshot, restore_range, verify_step
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.errors import AuthError, ConfigError, ProtocolError
from gossamer.faults import die_at
from gossamer.lr_schedule import LR_SCHEDULES, lr_multiplier
from gossamer.paramserver.consistency import SSPGate
from gossamer.paramserver.optimizer import OptimizerConfig, build_optimizer, set_lr_factor
from gossamer.paramserver.shard_plan import ShardPlan
from gossamer.security.curve import (
    CurveKeyring,
    HandshakeMonitor,
    MembershipAuthenticator,
    peer_key,
)
from gossamer.transport.frames import (
    ZERO_COPY_THRESHOLD,
    FrameLimits,
    Message,
    check_finite,
    decode,
    encode,
    frames_nbytes,
    peek_header,
)
from gossamer.transport.ratelimit import PeerRateLimiter, RateLimit

if TYPE_CHECKING:
    from gossamer.experiment import Experiment

__all__ = ["ShardConfig", "ShardServer", "chunk_key", "parse_chunk_key"]

logger = logging.getLogger(__name__)

_MODES = ("sync", "async")
_POLL_MS = 20
_EXPIRE_EVERY_S = 0.05
#: Ops only the workers send; a backup that receives one has been promoted by the coordinator.
_WORKER_OPS = ("HELLO", "PULL", "PUSH", "LEAVE")


def chunk_key(index: int) -> str:
    """The tensor name chunk `index` travels under."""
    return f"c{index}"


def parse_chunk_key(name: str) -> int:
    """Inverse of `chunk_key`; raises ProtocolError for any other name."""
    if len(name) < 2 or name[0] != "c" or not name[1:].isdigit() or len(name) > 12:
        raise ProtocolError(f"tensor name {name!r} is not a chunk key like 'c12'")
    return int(name[1:])


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Settings of one shard server."""

    experiment: str
    shard: int
    mode: str
    staleness: int | None
    optimizer: OptimizerConfig
    total_steps: int
    lr_staleness_scaling: bool = False
    lr_schedule: str = "constant"  # applied by the primary on top of the staleness factor
    warmup_steps: int = 0
    staleness_in_rounds: bool = False  # diloco async: tau = versions since the basis / workers
    expect_backup: bool = True  # False (ps_backup off): acks without a backup are not "unreplicated"
    worker_timeout_s: float = 30.0
    backup_timeout_s: float = 3.0
    checkpoint_every: int = 0
    #: Linear lr scaling (the experiment's `linear_lr_factor`, by the number of workers of
    #: an update); None: off.
    lr_linear: Callable[[int], float] | None = None
    #: Size limits of everything received (ZMQ MAXMSGSIZE and decoding); None: derived from
    #: the shard's size (`FrameLimits.for_values`).
    limits: FrameLimits | None = None
    #: Per-peer message rate (None: unlimited); a peer over it gets ERROR "RATE_LIMITED".
    rate_limit: RateLimit | None = field(default_factory=RateLimit)

    def __post_init__(self) -> None:
        if not isinstance(self.experiment, str) or not self.experiment:
            raise ConfigError("experiment", "must be a non-empty string")
        if not isinstance(self.shard, int) or self.shard < 0:
            raise ConfigError("shard", f"must be an int >= 0, got {self.shard!r}")
        if self.mode not in _MODES:
            raise ConfigError("mode", f"must be one of {_MODES}, got {self.mode!r}")
        if self.staleness is not None and (
            not isinstance(self.staleness, int)
            or isinstance(self.staleness, bool)
            or self.staleness < 0
        ):
            raise ConfigError("staleness", f"must be an int >= 0 or None, got {self.staleness!r}")
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError("optimizer", "must be an OptimizerConfig")
        if not isinstance(self.total_steps, int) or self.total_steps < 0:
            raise ConfigError("total_steps", f"must be an int >= 0, got {self.total_steps!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError("lr_schedule", f"must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not self.worker_timeout_s > 0:
            raise ConfigError("worker_timeout_s", f"must be > 0, got {self.worker_timeout_s!r}")
        if self.limits is not None and not isinstance(self.limits, FrameLimits):
            raise ConfigError("limits", "must be a FrameLimits or None")
        if self.rate_limit is not None and not isinstance(self.rate_limit, RateLimit):
            raise ConfigError("rate_limit", "must be a RateLimit or None")

    @classmethod
    def for_experiment(cls, exp: Experiment, experiment_id: str, shard: int) -> ShardConfig:
        """The settings a shard of `exp` runs with.

        diloco: the shard is the outer loop. It receives pseudo-gradients (theta_0 - theta_H)
        once per round and applies the outer optimizer, Nesterov SGD with `outer_lr` and
        `outer_momentum`; a version is one outer round, so `total_steps` inner steps are
        ceil(total_steps / inner_steps) versions. The outer step is synchronous (a barrier
        over the current workers, like sync mode) or asynchronous (applied on arrival,
        the lr divided by the staleness in rounds: versions since the basis / workers;
        no outer momentum).
        """
        if exp.mode == "diloco":
            # Momentum applies to the synchronous outer step only. Applied per arrival, it
            # carries stale pseudo-gradients past the optimum (digits, 4 workers, H=20: eval
            # accuracy 0.63 with Nesterov 0.6, 0.975 without); Delayed Nesterov (Liu et al.
            # 2024) is the known fix and is not built.
            momentum = exp.outer_momentum if exp.outer_step == "sync" else 0.0
            return cls(
                experiment=experiment_id, shard=shard,
                mode="sync" if exp.outer_step == "sync" else "async", staleness=None,
                optimizer=OptimizerConfig(name="sgd", lr=exp.outer_lr, momentum=momentum, nesterov=momentum > 0),
                total_steps=-(-exp.total_steps // exp.inner_steps), lr_staleness_scaling=True,
                staleness_in_rounds=True, expect_backup=exp.ps_backup,
                checkpoint_every=-(-exp.checkpoint_every // exp.inner_steps),
            )
        return cls(
            experiment=experiment_id, shard=shard, mode=exp.mode, staleness=exp.staleness,
            optimizer=OptimizerConfig(name=exp.optimizer, lr=exp.lr, momentum=exp.momentum,
                                      nesterov=exp.nesterov, weight_decay=exp.weight_decay),
            total_steps=exp.total_steps, lr_staleness_scaling=exp.lr_staleness_scaling,
            lr_schedule=exp.lr_schedule, warmup_steps=exp.warmup_steps,
            checkpoint_every=exp.checkpoint_every, expect_backup=exp.ps_backup,
            lr_linear=exp.linear_lr_factor if exp.lr_scaling != "none" else None,
        )


class _Reject(Exception):
    """A request that gets an ERROR reply; nothing of it is applied."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT", cause: str = "rejected") -> None:
        super().__init__(message)
        self.code = code
        self.cause = cause


@dataclass
class _Part:
    """One PUSH message of an update (a local rank's slice)."""

    identity: bytes
    rid: Any
    basis: int
    grads: dict[int, torch.Tensor]


@dataclass
class _Update:
    """The parts received so far of one worker's update for one clock (or step)."""

    sender: str
    key: int = 0  # the worker's clock (async) or step (sync)
    parts: list[_Part] = field(default_factory=list)
    covered: set[int] = field(default_factory=set)


class ShardServer:
    """Holds this shard's chunks and optimizer state; serves HELLO/PULL/PUSH/STATS/LEAVE.

    The serve loop is single-threaded; `stats`, `state_dict` and `values` may be called from
    other threads (they take the same lock as updates).
    """

    def __init__(
        self,
        config: ShardConfig,
        plan: ShardPlan,
        init: dict[int, torch.Tensor],
        *,
        shapes: dict[str, tuple[int, ...]] | None = None,
        backup: bool = False,
        curve: CurveKeyring | None = None,
    ) -> None:
        """`shapes`: parameter shapes by name, so compressed segments decode as matrices;
        `backup`: start as the backup replica (promoted by `promote`); `curve`: serve with
        CurveZMQ, accepting only the keyring's members (and use it to reach the backup)."""
        if config.shard >= plan.num_shards:
            raise ConfigError("shard", f"shard {config.shard} not in a plan of {plan.num_shards}")
        self.config = config
        self.plan = plan
        self._chunks = {c.index: c for c in plan.chunks_of_shard(config.shard)}
        if not self._chunks:
            raise ConfigError("shard", f"shard {config.shard} holds no chunks in this plan")
        if set(init) != set(self._chunks):
            raise ConfigError(
                "init", f"needs exactly chunks {sorted(self._chunks)}, got {sorted(init)}"
            )
        self._params: dict[int, torch.Tensor] = {}
        for idx, c in sorted(self._chunks.items()):
            value = init[idx].detach().reshape(-1).to(torch.float32).clone()
            if value.numel() != c.numel:
                raise ConfigError(
                    "init", f"chunk {idx} has {value.numel()} elements, not {c.numel}"
                )
            self._params[idx] = value
        self._optimizer = build_optimizer(config.optimizer, list(self._params.values()))
        self.limits = config.limits or FrameLimits.for_values(plan.shard_numel(config.shard))
        self._curve = curve
        self._auth: MembershipAuthenticator | None = None
        self._rate = PeerRateLimiter(config.rate_limit) if config.rate_limit is not None else None
        self._rate_logged = 0.0
        self.not_member = 0  # messages on a connection whose key is no longer a member's
        self._backup_watch: HandshakeMonitor | None = None
        self._backup_retry_at = 0.0
        self._gate: SSPGate[tuple[bytes, Any, list[int]]] = SSPGate(
            config.staleness if config.mode == "async" else None,
            lr_staleness_scaling=config.lr_staleness_scaling,
            staleness_in_rounds=config.staleness_in_rounds,
            worker_timeout_s=config.worker_timeout_s,
        )
        self._shapes = dict(shapes or {})
        self._decoders: dict[tuple[str, tuple[tuple[str, str], ...]], ChunkCompressor] = {}
        # Pull compression: what each worker holds of every chunk, so replies carry the
        # compressed difference; what a lossy codec drops stays in the next difference.
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._pull_encoders: dict[str, ChunkCompressor] = {}
        self._pull_of: dict[bytes, tuple[str, str]] = {}  # ZMQ identity -> (sender, pull codec)
        self.raw_bytes_out = 0
        self._version = 0
        self._pending: dict[tuple[str, int], _Update] = {}
        self._sync_step: dict[str, _Update] = {}
        self._sync_num_workers: int | None = None
        self._lock = threading.RLock()  # re-entered: posted commands may call locking methods
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.endpoint = ""
        self.updates = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.errors = 0
        self.dropped = 0
        # Every update not applied, by cause (rejected, nonfinite, aborted, duplicate,
        # partial, reform, wrong_step); reported to the coordinator.
        self.discarded: Counter[str] = Counter()
        self._applied: dict[str, int] = {}  # sender -> last applied clock (async) / step (sync)
        self._sync_generation = 0
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.is_primary = not backup
        self.promotions = 0
        self.backup_endpoint = ""
        self._backup_sock: zmq.Socket | None = None
        self._acked = 0
        self._awaiting: deque[tuple[int, float, Callable[[], None]]] = deque()
        self.unreplicated = 0  # updates acknowledged to workers without a backup copy
        self.replicated_updates = 0
        self.backup_detaches = 0
        self._synced = False
        # After a restore from a checkpoint: what each worker had applied then. A worker's first
        # push afterwards shows how many of its updates the restore rolled back.
        self._restored_applied: dict[str, int] | None = None
        self._seen_since_restore: set[str] = set()
        self.versions_lost = 0
        self.on_snapshot: Callable[[int], None] | None = None  # called at checkpoint boundaries

    # -- lifecycle --------------------------------------------------------------------
    def bind(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Bind the ROUTER socket; returns ``tcp://host:port`` (the real port if 0)."""
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.copy_threshold = ZERO_COPY_THRESHOLD  # pyzmq copies below this; see frames.py
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self._curve is not None:
            self._auth = self._curve.authenticator(self._ctx)
            self._curve.secure_server(sock)
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        self._sock = sock
        self.endpoint = f"tcp://{host}:{port}"
        logger.info(
            "shard %d of %r serving %d chunks at %s",
            self.config.shard,
            self.config.experiment,
            len(self._chunks),
            self.endpoint,
        )
        return self.endpoint

    def start(self) -> threading.Thread:
        """Run `serve` in a daemon thread (binding to a random loopback port if needed)."""
        if self._sock is None:
            self.bind()
        self._thread = threading.Thread(
            target=self.serve, args=(self._stop,), name=f"shard-{self.config.shard}", daemon=True
        )
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop the loop (if started here) and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._close_backup()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def serve(self, stop: threading.Event) -> None:
        """The single-threaded poll loop; returns when `stop` is set."""
        sock = self._sock
        if sock is None:
            raise RuntimeError("bind() before serve()")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        polled_backup: zmq.Socket | None = None
        next_expire = time.monotonic() + _EXPIRE_EVERY_S
        while not stop.is_set():
            self._run_commands()
            if polled_backup is not self._backup_sock:
                if polled_backup is not None and polled_backup in dict(poller.sockets):
                    poller.unregister(polled_backup)
                polled_backup = self._backup_sock
                if polled_backup is not None:
                    poller.register(polled_backup, zmq.POLLIN)
            ready = dict(poller.poll(_POLL_MS))
            if polled_backup is not None and polled_backup in ready:
                self._on_backup_replies(polled_backup)
            if sock in ready:
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
            now = time.monotonic()
            if now >= next_expire:
                next_expire = now + _EXPIRE_EVERY_S
                with self._lock:
                    dead, released = self._gate.expire(now)
                    for worker in dead:
                        self._discard_pending_of(worker)
                    # Also whoever waited on a worker that has just turned suspect.
                    self._send_released(released + self._gate.release(now))
                    self._check_backup(now)

    # -- commands from other threads (role process: assignment updates) ------------------
    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the serve thread (under the lock) at the next loop iteration."""
        self._commands.put(fn)

    def _run_commands(self) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                try:
                    fn()
                except Exception:  # noqa: BLE001 — a bad command must not stop the shard
                    logger.exception("shard %d: command failed", self.config.shard)

    def set_members(self, senders: list[str], generation: int | None = None) -> None:
        """The coordinator's current workers: anyone else is gone (kill -9, lost lease).

        Their SSP waits are released at once and their half-received updates discarded. In
        sync mode a newer `generation` re-forms the barrier: contributions to the current
        step are refused with REFORM and redone by the survivors over the new membership.
        """
        if self.config.mode == "sync" and generation is not None and generation > self._sync_generation:
            self._reform(generation)
        members = set(senders)
        now = time.monotonic()
        for worker in self._gate.active:
            if worker not in members:
                logger.info("shard %d: worker %s is no longer a member", self.config.shard, worker)
                self._discard_pending_of(worker)
                self._send_released(self._gate.leave(worker, now))

    def _discard_pending_of(self, worker: str) -> None:
        for key in [k for k in self._pending if k[0] == worker]:
            self.discarded["partial"] += 1
            self._abort(key, f"worker {worker} left with its update incomplete")

    def promote(self, reason: str = "promoted by the coordinator") -> None:
        """Become the primary: serve workers, take checkpoints."""
        if self.is_primary:
            return
        self.is_primary = True
        self.promotions += 1
        logger.warning("shard %d: backup promoted to primary at version %d (%s)", self.config.shard,
                       self._version, reason)

    # -- replication (primary side) --------------------------------------------------
    @property
    def replicated(self) -> bool:
        """True once a backup is attached and synced (acknowledged updates are on two replicas)."""
        return self._backup_sock is not None and self._synced

    def set_backup(self, endpoint: str) -> None:
        """Attach (or with "" detach) the backup at `endpoint`; it first gets a full SYNC."""
        if endpoint == self.backup_endpoint and (self._backup_sock is not None or not endpoint):
            return
        self._close_backup()
        self.backup_endpoint = endpoint
        if not endpoint:
            self._flush_awaiting(replicated=False)
            return
        assert self._ctx is not None
        b = self._ctx.socket(zmq.DEALER)
        b.copy_threshold = ZERO_COPY_THRESHOLD
        b.setsockopt(zmq.LINGER, 0)
        b.setsockopt(zmq.SNDHWM, 0)
        b.setsockopt(zmq.RCVHWM, 0)
        b.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        if self._curve is not None:
            try:
                self._curve.secure_client(b, endpoint)
            except AuthError as e:
                b.close(linger=0)
                logger.error("shard %d: cannot attach backup %s: %s", self.config.shard, endpoint, e)
                return
            self._backup_watch = HandshakeMonitor(b)
        b.connect(endpoint)
        self._backup_sock = b
        self._synced = False
        self._send_sync()
        logger.info("shard %d: backup %s attached at version %d", self.config.shard, endpoint, self._version)

    def _close_backup(self) -> None:
        if self._backup_watch is not None:
            self._backup_watch.close()
            self._backup_watch = None
        if self._backup_sock is not None:
            self._backup_sock.close(linger=0)
            self._backup_sock = None

    def _send_sync(self) -> None:
        meta, tensors = self._export_state()
        self._send_backup("SYNC", meta, tensors)

    def _send_backup(self, op: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        assert self._backup_sock is not None
        msg = Message(op=op, experiment=self.config.experiment, shard=self.config.shard,
                      version=self._version, sender=f"shard-{self.config.shard}", meta=meta, tensors=tensors)
        frames = encode(msg)
        self.bytes_out += frames_nbytes(frames)
        self._backup_sock.send_multipart(frames, copy=False)

    def _replicate(self, grads: dict[int, torch.Tensor], lr_factor: float, applied: list[tuple[str, int]]) -> None:
        if self._backup_sock is None:
            return
        self._send_backup(
            "REPLICATE",
            {"lr_factor": lr_factor, "applied": [[s, k] for s, k in applied]},
            {chunk_key(i): g for i, g in grads.items()},
        )
        self.replicated_updates += 1

    def _on_backup_replies(self, b: zmq.Socket) -> None:
        while True:
            try:
                frames = b.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = decode(frames, self.limits)
            except ProtocolError as e:
                logger.warning("shard %d: undecodable reply from the backup: %s", self.config.shard, e)
                continue
            with self._lock:
                if reply.op == "ACK":
                    self._synced = True
                    self._acked = max(self._acked, reply.version)
                    self._flush_awaiting(replicated=True)
                elif reply.meta.get("code") == "OUT_OF_ORDER":
                    logger.warning("shard %d: backup out of order (%s); re-syncing", self.config.shard,
                                   reply.meta.get("error"))
                    self._send_sync()
                else:
                    logger.error("shard %d: backup refused replication: %s; detaching it", self.config.shard,
                                 reply.meta.get("error"))
                    self._detach_backup()

    def _check_backup(self, now: float) -> None:
        watch = self._backup_watch
        if watch is not None and watch.check() is not None and watch.fatal and now >= self._backup_retry_at:
            # libzmq gave up on this connection (the backup does not know our key yet, or
            # not any more): try again on a new socket, with a full SYNC, once a second.
            logger.error("shard %d: backup %s refused the CURVE handshake: %s; retrying", self.config.shard,
                         self.backup_endpoint, watch.failure)
            self._backup_retry_at = now + 1.0
            endpoint, self.backup_endpoint = self.backup_endpoint, ""
            self._close_backup()
            self.set_backup(endpoint)
        if self._awaiting and now - self._awaiting[0][1] > self.config.backup_timeout_s:
            logger.error("shard %d: backup %s silent for %.1fs; acknowledging unreplicated until a new "
                         "backup is attached", self.config.shard, self.backup_endpoint, self.config.backup_timeout_s)
            self._detach_backup()

    def _detach_backup(self) -> None:
        self._close_backup()
        self.backup_detaches += 1
        self._flush_awaiting(replicated=False)

    def _after_backup(self, reply: Callable[[], None]) -> None:
        """Send `reply` now, or once the backup holds the current version."""
        if self._backup_sock is not None and self._version > self._acked:
            self._awaiting.append((self._version, time.monotonic(), reply))
        else:
            if self.is_primary and self._backup_sock is None and self.config.expect_backup:
                self.unreplicated += 1
            reply()

    def _flush_awaiting(self, *, replicated: bool) -> None:
        while self._awaiting and (not replicated or self._awaiting[0][0] <= self._acked):
            _, _, reply = self._awaiting.popleft()
            if not replicated:
                self.unreplicated += 1
            reply()

    # -- state transfer (SYNC, checkpoints) --------------------------------------------
    def _export_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Chunk values and optimizer state as tensors ("c3", "c3/momentum_buffer") + meta."""
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, float] = {}
        opt = self._optimizer.state_dict()["state"]
        for i, idx in enumerate(sorted(self._params)):
            tensors[chunk_key(idx)] = self._params[idx].clone()
            for name, val in opt.get(i, {}).items():
                if isinstance(val, torch.Tensor) and val.dim() > 0:
                    tensors[f"{chunk_key(idx)}/{name}"] = val.detach().clone()
                elif isinstance(val, torch.Tensor):
                    scalars[f"{idx}/{name}"] = float(val.item())
                elif isinstance(val, int | float):
                    scalars[f"{idx}/{name}"] = float(val)
        return {"applied": dict(self._applied), "scalars": scalars, "state_version": self._version}, tensors

    def snapshot(self, step: int) -> ShardSnapshot:
        """This shard's state for a sharded checkpoint (copies; call on the serve thread)."""
        meta, tensors = self._export_state()
        pieces: dict[int, dict[str, torch.Tensor]] = {}
        scalars: dict[int, dict[str, float]] = {}
        for idx, c in self._chunks.items():
            key = chunk_key(idx)
            entry = {"param": tensors[key]}
            entry.update({n.split("/", 1)[1]: t for n, t in tensors.items() if n.startswith(f"{key}/")})
            pieces[c.flat_offset] = entry
            sc = {k.split("/", 1)[1]: v for k, v in meta["scalars"].items() if k.split("/", 1)[0] == str(idx)}
            if sc:
                scalars[c.flat_offset] = sc
        layout = [(name, list(self._shapes.get(name, (numel,)))) for name, numel in self.plan.params]
        return ShardSnapshot(
            experiment=self.config.experiment, step=step, shard=self.config.shard,
            num_shards=self.plan.num_shards, total_numel=self.plan.total_numel, version=self._version,
            pieces=pieces, scalars=scalars, layout=layout, extra={"applied": meta["applied"], "env": _environment()},
        )

    def restore(self, step_dir: str) -> int:
        """Load this shard's chunks from a sharded checkpoint (any number of shards saved it).

        Returns the restored version. Raises CheckpointError if the checkpoint fails its checks.
        """
        manifests = verify_step(step_dir)
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, float] = {}
        versions = []
        for idx, c in sorted(self._chunks.items()):
            states, sc, version = restore_range(step_dir, c.flat_offset, c.numel, manifests)
            key = chunk_key(idx)
            tensors[key] = states.pop("param")
            tensors.update({f"{key}/{name}": t for name, t in states.items()})
            scalars.update({f"{idx}/{name}": v for name, v in sc.items()})
            versions.append(version)
        applied: dict[str, int] = {}
        for m in manifests:
            for sender, clock in (m.get("extra") or {}).get("applied", {}).items():
                applied[sender] = max(applied.get(sender, -1), int(clock))
        with self._lock:
            # Updates half-gathered for the old state are void: their workers pull and redo.
            self._void_waiting(f"shard {self.config.shard} rolled back to a checkpoint; pull and redo the step",
                               "FAILED_PRECONDITION", "rolled_back")
            self._import_state(min(versions), applied, tensors, scalars)
            self._views.clear()
            self._restored_applied = dict(applied)
            self._seen_since_restore = set()
        logger.warning("shard %d restored from %s at version %d", self.config.shard, step_dir, self._version)
        return self._version

    def _import_state(self, version: int, applied: Any, tensors: dict[str, torch.Tensor],
                      scalars: dict[str, float]) -> None:
        if not isinstance(applied, dict) or not isinstance(scalars, dict):
            raise _Reject("state meta 'applied' and 'scalars' must be maps")
        for idx, c in self._chunks.items():
            t = tensors.get(chunk_key(idx))
            if t is None or t.numel() != c.numel:
                raise _Reject(f"state lacks chunk {idx} or has the wrong size")
        state: dict[int, dict[str, Any]] = {}
        for i, idx in enumerate(sorted(self._params)):
            entry: dict[str, Any] = {}
            prefix = f"{chunk_key(idx)}/"
            for name, t in tensors.items():
                if name.startswith(prefix):
                    if t.numel() != self._chunks[idx].numel:
                        raise _Reject(f"state tensor {name} has the wrong size")
                    entry[name[len(prefix):]] = t.detach().reshape(-1).to(torch.float32).clone()
            for key, val in scalars.items():
                if key.startswith(f"{idx}/"):
                    entry[key.split("/", 1)[1]] = torch.tensor(float(val))
            if entry:
                state[i] = entry
        for idx, p in self._params.items():
            p.copy_(tensors[chunk_key(idx)].reshape(-1))
        groups = self._optimizer.state_dict()["param_groups"]
        self._optimizer.load_state_dict({"state": state, "param_groups": groups})
        self._version = int(version)
        self._acked = self._version
        self._applied = {str(k): int(v) for k, v in applied.items()}

    # -- state ------------------------------------------------------------------------
    @property
    def decode_seconds(self) -> float:
        """Time spent decompressing pushes (all codecs)."""
        with self._lock:
            return sum(d.decode_seconds for d in self._decoders.values())

    @property
    def version(self) -> int:
        return self._version

    @property
    def done(self) -> bool:
        return self._version >= self.config.total_steps

    def values(self) -> dict[int, torch.Tensor]:
        """Copies of this shard's chunk values, by chunk index."""
        with self._lock:
            return {idx: p.clone() for idx, p in self._params.items()}

    def state_dict(self) -> dict[str, Any]:
        """Chunk values, optimizer state and version, for checkpointing."""
        with self._lock:
            return {
                "experiment": self.config.experiment,
                "shard": self.config.shard,
                "plan_fingerprint": self.plan.fingerprint(),
                "version": self._version,
                "values": {idx: p.clone() for idx, p in self._params.items()},
                "optimizer": _clone_state(self._optimizer.state_dict()),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (same plan and shard)."""
        if state.get("plan_fingerprint") != self.plan.fingerprint():
            raise ConfigError("plan", "checkpoint was taken with a different shard plan")
        with self._lock:
            for idx, p in self._params.items():
                p.copy_(state["values"][idx])
            self._optimizer.load_state_dict(state["optimizer"])
            self._version = int(state["version"])

    def stats(self) -> dict[str, Any]:
        """Counters and histograms (the STATS reply's meta)."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        gate = self._gate.stats()
        return {
            "experiment": self.config.experiment,
            "shard": self.config.shard,
            "mode": self.config.mode,
            "version": self._version,
            "done": self.done,
            "updates": self.updates,
            "staleness": gate["staleness"],
            "version_staleness": gate["version_staleness"],
            "waits": gate["waits"],
            "wait_seconds": gate["wait_seconds"],
            "clocks": gate["clocks"],
            "active": gate["active"],
            "held": self._gate.held_count(),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "raw_bytes_out": self.raw_bytes_out,
            "errors": self.errors,
            "dropped": self.dropped,
            "discarded": dict(self.discarded),
            "primary": self.is_primary,
            "replicated": self.replicated,
            "unreplicated": self.unreplicated,
            "backup_detaches": self.backup_detaches,
            "promotions": self.promotions,
            "generation": self._sync_generation,
            "applied": dict(self._applied),
            "versions_lost": self.versions_lost,
            "rate_limited": self._rate.refused if self._rate is not None else 0,
            "not_member": self.not_member,
            "curve_refused": self._auth.refused if self._auth is not None else 0,
        }

    # -- request handling -------------------------------------------------------------
    def _on_frames(self, frames: Sequence[zmq.Frame]) -> None:
        if len(frames) < 2 or len(frames[0].buffer) == 0:
            self.dropped += 1
            logger.warning(
                "shard %d: dropped a message without a routable identity", self.config.shard
            )
            return
        identity = frames[0].bytes
        payload = frames[1:]
        self.bytes_in += frames_nbytes(payload)
        if self._curve is not None and not self._curve.is_member(peer_key(payload[0])):
            self.not_member += 1
            self._refuse_early(identity, payload, "this node's CURVE key is not a member of the experiment "
                               "(any more)", "PERMISSION_DENIED")
            return
        if self._rate is not None and not self._rate.allow(identity, time.monotonic()):
            if self._rate.answer(identity, time.monotonic()):
                self._refuse_early(identity, payload, f"rate limit: over {self._rate.limit.messages_per_s:g} "
                                   "messages/s from this peer", "RATE_LIMITED")
            return
        rid: Any = None
        op = ""
        try:
            msg = decode(payload, self.limits)
            rid, op = msg.meta.get("rid"), msg.op
            with self._lock:
                self._dispatch(identity, msg)
        except ProtocolError as e:
            if op == "PUSH" or not op:
                self.discarded["nonfinite" if "finite" in str(e) else "rejected"] += 1
            self._reply_error(identity, rid, str(e), "INVALID_ARGUMENT")
        except _Reject as e:
            if op == "PUSH":
                self.discarded["nonfinite" if "not finite" in str(e) else e.cause] += 1
            self._reply_error(identity, rid, str(e), e.code)
        except Exception as e:  # keep serving whatever one request did
            logger.exception("shard %d: internal error handling a request", self.config.shard)
            self._reply_error(identity, rid, f"internal error: {type(e).__name__}: {e}", "INTERNAL")

    def _refuse_early(self, identity: bytes, payload: Sequence[zmq.Frame], message: str, code: str) -> None:
        """An ERROR reply to a request refused before decoding (rate limit, revoked key)."""
        header = peek_header(payload[0], self.limits)
        meta = header.get("meta") if header is not None else None
        rid = meta.get("rid") if isinstance(meta, dict) else None
        if not isinstance(rid, int | str | None) or isinstance(rid, bool):
            rid = None
        now = time.monotonic()
        if now - self._rate_logged > 5.0:  # a flood must not flood the log too
            self._rate_logged = now
            logger.warning("shard %d: refused a request: %s (%s)", self.config.shard, message, code)
        try:
            self._reply(identity, "ERROR", {"rid": rid, "error": message, "code": code})
        except zmq.ZMQError as e:
            logger.warning("shard %d: could not send an error reply: %s", self.config.shard, e)

    def _dispatch(self, identity: bytes, msg: Message) -> None:
        if msg.experiment != self.config.experiment:
            raise _Reject(
                f"experiment {msg.experiment!r} does not match this shard's "
                f"{self.config.experiment!r}",
                "FAILED_PRECONDITION",
            )
        if msg.shard != self.config.shard:
            raise _Reject(f"message for shard {msg.shard} reached shard {self.config.shard}")
        now = time.monotonic()
        rid = msg.meta.get("rid")
        if msg.op in _WORKER_OPS and not self.is_primary:
            # Workers learn a backup's endpoint only from the coordinator's promotion.
            self.promote("a worker was directed here")
        if msg.op == "REPLICATE":
            self._on_replicate(identity, msg)
        elif msg.op == "SYNC":
            if self.is_primary:
                raise _Reject("SYNC sent to a primary", "NOT_BACKUP")
            self._import_state(msg.meta.get("state_version", -1), msg.meta.get("applied"), msg.tensors,
                               msg.meta.get("scalars", {}))
            logger.info("shard %d: backup synced at version %d", self.config.shard, self._version)
            self._reply(identity, "ACK", {"rid": rid})
        elif msg.op == "HELLO":
            if msg.meta.get("fresh") and msg.sender:
                # A new process under this id: its clocks restart, so forget the old ones.
                self._applied.pop(msg.sender, None)
                self._gate.forget(msg.sender)
            self._gate.join(msg.sender or identity.hex(), now)
            self._reply(
                identity,
                "WELCOME",
                {"rid": rid, "done": self.done, "plan": self.plan.fingerprint()},
            )
        elif msg.op == "PULL":
            if msg.sender:
                self._gate.touch(msg.sender, now)
            chunks = self._pull_chunks(msg)
            self._note_pull_codec(identity, msg)
            for idx in chunks:  # a PULL restarts the worker's view: full values follow
                self._views.pop((msg.sender, idx), None)
            self._reply_params(identity, rid, chunks, {})
        elif msg.op == "PUSH":
            self._on_push(identity, msg, now)
        elif msg.op == "STATS":
            self._reply(identity, "STATS", {"rid": rid, **self._stats()})
        elif msg.op == "LEAVE":
            for key in [k for k in self._views if k[0] == msg.sender]:
                del self._views[key]
            self._discard_pending_of(msg.sender)
            released = self._gate.leave(msg.sender, now)
            self._send_released(released)
            self._reply(identity, "BYE", {"rid": rid})
        else:
            raise _Reject(f"unknown op {msg.op!r}", "UNIMPLEMENTED")

    def _on_replicate(self, identity: bytes, msg: Message) -> None:
        if self.is_primary:
            raise _Reject("REPLICATE sent to a primary (this replica was promoted)", "NOT_BACKUP")
        if msg.version != self._version + 1:
            raise _Reject(f"REPLICATE of version {msg.version} but this backup is at {self._version}",
                          "OUT_OF_ORDER")
        grads: dict[int, torch.Tensor] = {}
        for name, t in msg.tensors.items():
            idx = parse_chunk_key(name)
            c = self._chunks.get(idx)
            if c is None or t.dtype != torch.float32 or tuple(t.shape) != (c.numel,):
                raise _Reject(f"REPLICATE tensor {name!r} does not fit this shard")
            grads[idx] = t
        if set(grads) != set(self._chunks):
            raise _Reject("REPLICATE must carry every chunk of the shard")
        factor = msg.meta.get("lr_factor", 1.0)
        applied = msg.meta.get("applied", [])
        if not isinstance(factor, int | float) or not isinstance(applied, list):
            raise _Reject("REPLICATE meta 'lr_factor' must be a number and 'applied' a list")
        self._apply(grads, float(factor))
        for item in applied:
            if isinstance(item, list) and len(item) == 2 and isinstance(item[1], int):
                self._applied[str(item[0])] = max(self._applied.get(str(item[0]), -1), item[1])
        self._reply(identity, "ACK", {"rid": msg.meta.get("rid")})

    def _pull_chunks(self, msg: Message) -> list[int]:
        if msg.tensors:
            raise _Reject("PULL carries no tensors")
        chunks = msg.meta.get("chunks")
        if chunks is None:
            return sorted(self._chunks)
        if not isinstance(chunks, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in chunks
        ):
            raise _Reject("PULL meta 'chunks' must be a list of ints")
        unknown = [i for i in chunks if i not in self._chunks]
        if unknown:
            raise _Reject(f"chunks {unknown[:8]} are not on shard {self.config.shard}", "NOT_FOUND")
        return list(chunks)

    def _meta_int(self, msg: Message, key: str, minimum: int = 0) -> int:
        value = msg.meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise _Reject(f"PUSH meta {key!r} must be an int >= {minimum}, got {value!r}")
        return value

    def _decoder(self, spec: Any, overrides: Any) -> ChunkCompressor:
        if not isinstance(spec, str) or not isinstance(overrides, list):
            raise _Reject("PUSH meta 'codec' must be a string and 'codec_overrides' a list")
        pairs: list[tuple[str, str]] = []
        for item in overrides:
            if not (
                isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)
            ):
                raise _Reject("PUSH meta 'codec_overrides' must hold [pattern, codec] pairs")
            pairs.append((item[0], item[1]))
        key = (spec, tuple(pairs))
        decoder = self._decoders.get(key)
        if decoder is None:
            try:
                decoder = ChunkCompressor(spec, self.plan, overrides=pairs, shapes=self._shapes)
            except ConfigError as e:
                raise _Reject(f"cannot decode: {e}") from None
            if (
                len(self._decoders) >= 64
            ):  # an adaptive sender changes choices; keep a bounded cache
                self._decoders.pop(next(iter(self._decoders)))
            self._decoders[key] = decoder
        return decoder

    def _decompress(self, msg: Message) -> dict[int, torch.Tensor]:
        chunk_meta = msg.meta["compression"]
        if not isinstance(chunk_meta, dict) or not chunk_meta:
            raise _Reject("PUSH meta 'compression' must map chunk index -> chunk meta")
        decoder = self._decoder(msg.meta.get("codec"), msg.meta.get("codec_overrides", []))
        grads: dict[int, torch.Tensor] = {}
        for key, meta in chunk_meta.items():
            if not isinstance(key, str) or not key.isdigit() or len(key) > 9:
                raise _Reject(f"compressed chunk key {key!r} is not a chunk index")
            idx = int(key)
            if idx not in self._chunks:
                raise _Reject(f"chunk {idx} is not on shard {self.config.shard}", "NOT_FOUND")
            grads[idx] = decoder.decode(idx, msg.tensors, meta)
        stray = {n.split("/", 1)[0] for n in msg.tensors} - {f"c{i}" for i in grads}
        if stray:
            raise _Reject(f"tensors {sorted(stray)[:4]} belong to no declared compressed chunk")
        for idx, g in grads.items():
            if not bool(torch.isfinite(g).all()):
                raise _Reject(f"chunk {idx}: decoded gradient is not finite")
        return grads

    def _validate_grads(self, msg: Message) -> dict[int, torch.Tensor]:
        if not msg.tensors:
            raise _Reject("PUSH carries no gradients")
        if "compression" in msg.meta:
            return self._decompress(msg)
        grads: dict[int, torch.Tensor] = {}
        for name, t in msg.tensors.items():
            idx = parse_chunk_key(name)
            c = self._chunks.get(idx)
            if c is None:
                raise _Reject(f"chunk {idx} is not on shard {self.config.shard}", "NOT_FOUND")
            if t.dtype != torch.float32:
                raise _Reject(f"gradient {name!r} must be float32, got {t.dtype}")
            if tuple(t.shape) != (c.numel,):
                raise _Reject(f"gradient {name!r} must have shape [{c.numel}], got {list(t.shape)}")
            grads[idx] = t
        check_finite(msg)
        return grads

    def _note_pull_codec(self, identity: bytes, msg: Message) -> None:
        spec = msg.meta.get("pull_codec", "none")
        if not isinstance(spec, str) or len(spec) > 64:
            raise _Reject("meta 'pull_codec' must be a codec spec string")
        if spec == "none":
            self._pull_of.pop(identity, None)
            return
        if spec not in self._pull_encoders:
            try:
                self._pull_encoders[spec] = ChunkCompressor(
                    spec, self.plan, error_feedback=False, shapes=self._shapes
                )
            except ConfigError as e:
                raise _Reject(f"pull_codec: {e}") from None
        if not msg.sender:
            raise _Reject("pull compression needs a sender id")
        self._pull_of[identity] = (msg.sender, spec)

    def _on_push(self, identity: bytes, msg: Message, now: float) -> None:
        rid = msg.meta.get("rid")
        self._note_pull_codec(identity, msg)
        clock = self._meta_int(msg, "clock")
        basis = self._meta_int(msg, "basis")
        sync = self.config.mode == "sync"
        step = num_workers = 0
        if sync:
            step = self._meta_int(msg, "step")
            num_workers = self._meta_int(msg, "num_workers", 1)
        sender = msg.sender
        if not sender:
            raise _Reject("PUSH needs a sender id")
        key = (sender, step if sync else clock)
        try:
            grads = self._validate_grads(msg)
        except (_Reject, ProtocolError) as e:
            # One bad part spoils the whole update: never apply the other parts alone.
            self._abort(key, f"another part was rejected: {e}")
            raise
        self._gate.touch(sender, now)
        if self._restored_applied is not None and not sync and sender not in self._seen_since_restore:
            self._seen_since_restore.add(sender)
            lost = max(0, clock - 1 - self._restored_applied.get(sender, -1))
            if lost:
                logger.warning("shard %d: %d update(s) of %s were lost with the restore", self.config.shard, lost,
                               sender)
                self.versions_lost += lost
        if key[1] <= self._applied.get(sender, -1):
            # A retry (after a failover) of an update this shard already applied.
            self.discarded["duplicate"] += 1
            chunks = sorted(grads)
            self._after_backup(lambda: self._reply_params(identity, rid, chunks, {"staleness": 0}))
            return
        if self.done:
            self._reply_params(identity, rid, sorted(grads), {"staleness": 0})
            return
        if sync:
            self._check_generation(msg)
            if step != self._version:
                raise _Reject(
                    f"sync push for step {step} but the shard is at step {self._version}",
                    "FAILED_PRECONDITION", cause="wrong_step",
                )
        update = self._pending.get(key)
        if update is None:
            update = self._pending[key] = _Update(sender=sender, key=key[1])
        overlap = update.covered.intersection(grads)
        if overlap:
            # A duplicated chunk means the update is inconsistent: drop all of it.
            self._abort(key, f"chunks {sorted(overlap)[:8]} pushed twice for one update")
            raise _Reject(f"chunks {sorted(overlap)[:8]} pushed twice for one update")
        update.parts.append(_Part(identity=identity, rid=rid, basis=basis, grads=grads))
        update.covered.update(grads)
        if len(update.covered) < len(self._chunks):
            return
        del self._pending[key]
        if sync:
            self._on_sync_contribution(update, num_workers, now)
        else:
            self._apply_async(update, now)

    def _abort(self, key: tuple[str, int], reason: str, code: str = "ABORTED") -> None:
        update = self._pending.pop(key, None)
        if update is None:
            return
        if code == "ABORTED":
            self.discarded["aborted"] += 1
        for part in update.parts:
            self._reply_error(part.identity, part.rid, f"update aborted: {reason}", code)

    def _check_generation(self, msg: Message) -> None:
        """Sync barrier membership: a newer generation re-forms it, an older one must redo."""
        gen = msg.meta.get("generation", 0)
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise _Reject(f"PUSH meta 'generation' must be an int >= 0, got {gen!r}")
        if gen < self._sync_generation:
            raise _Reject(f"the barrier re-formed at generation {self._sync_generation}; redo the step "
                          "with the new membership", "REFORM", cause="reform")
        if gen > self._sync_generation:
            self._reform(gen)

    def _reform(self, gen: int) -> None:
        self._sync_generation = gen
        waiting = len(self._sync_step) + len(self._pending)
        if waiting:
            logger.info("shard %d: barrier re-forms at generation %d; %d contribution(s) to step %d "
                        "must be redone", self.config.shard, gen, waiting, self._version)
        self._void_waiting(f"the barrier re-formed at generation {gen}; redo the step with the new membership",
                           "REFORM", "reform")

    def _void_waiting(self, why: str, code: str, cause: str) -> None:
        """Refuse every update still being gathered (parts, sync contributions); count each."""
        for key in list(self._pending):
            self.discarded[cause] += 1
            self._abort(key, why, code)
        for contrib in self._sync_step.values():
            self.discarded[cause] += 1
            for part in contrib.parts:
                self._reply_error(part.identity, part.rid, why, code)
        self._sync_step = {}
        self._sync_num_workers = None

    def _apply(self, grads: dict[int, torch.Tensor], lr_factor: float,
               applied: list[tuple[str, int]] | None = None) -> None:
        for idx, p in self._params.items():
            p.grad = grads[idx]
        if applied is not None:  # a primary schedules; its backup replays the factor it is sent
            lr_factor *= lr_multiplier(self._version, self.config.total_steps, self.config.lr_schedule,
                                       self.config.warmup_steps)
        set_lr_factor(self._optimizer, self.config.optimizer.lr, lr_factor)
        self._optimizer.step()
        for p in self._params.values():
            p.grad = None
        self._version += 1
        self.updates += 1
        if applied is not None:  # a primary: remember, and forward to the backup
            for sender, key in applied:
                self._applied[sender] = key
            self._replicate(grads, lr_factor, applied)
            die_at("after-apply", step=self._version, shard=self.config.shard)
        every = self.config.checkpoint_every
        if self.is_primary and every and self._version % every == 0 and self.on_snapshot is not None:
            self.on_snapshot(self._version)

    def _linear(self, num_workers: int) -> float:
        return 1.0 if self.config.lr_linear is None else self.config.lr_linear(num_workers)

    def _apply_async(self, update: _Update, now: float) -> None:
        basis = min(p.basis for p in update.parts)
        record = self._gate.on_apply(update.sender, version=self._version, basis=basis, now=now)
        grads: dict[int, torch.Tensor] = {}
        for part in update.parts:
            grads.update(part.grads)
        self._apply(grads, record.lr_factor * self._linear(1), [(update.sender, update.key)])
        extra = {"staleness": record.version_staleness, "lead": record.lead}
        if self._gate.must_wait(update.sender, now):
            for part in update.parts:
                self._gate.hold(update.sender, (part.identity, part.rid, sorted(part.grads)), now)
        else:
            for part in update.parts:
                self._after_backup(
                    lambda p=part: self._reply_params(p.identity, p.rid, sorted(p.grads), extra)  # type: ignore[misc]
                )
        self._send_released(self._gate.release(now))

    def _on_sync_contribution(self, update: _Update, num_workers: int, now: float) -> None:
        if self._sync_num_workers is None:
            self._sync_num_workers = num_workers
        if num_workers != self._sync_num_workers or update.sender in self._sync_step:
            self.discarded["rejected"] += 1
            reason = (
                f"{update.sender!r} already contributed to step {self._version}"
                if update.sender in self._sync_step
                else f"num_workers {num_workers} != {self._sync_num_workers} for this step"
            )
            for part in update.parts:
                self._reply_error(part.identity, part.rid, reason, "FAILED_PRECONDITION")
            return
        self._sync_step[update.sender] = update
        if len(self._sync_step) < num_workers:
            return
        contributions = [self._sync_step[s] for s in sorted(self._sync_step)]
        self._sync_step = {}
        self._sync_num_workers = None
        summed: dict[int, torch.Tensor] = {}
        for contrib in contributions:  # a fixed order (by sender) keeps the sum deterministic
            for part in contrib.parts:
                for idx, g in part.grads.items():
                    if idx in summed:
                        summed[idx].add_(g)
                    else:
                        summed[idx] = g.clone()
            self._gate.on_apply(contrib.sender, version=self._version, basis=self._version, now=now)
        self._apply(summed, self._linear(len(contributions)), [(c.sender, c.key) for c in contributions])
        for contrib in contributions:
            for part in contrib.parts:
                self._after_backup(
                    lambda p=part: self._reply_params(p.identity, p.rid, sorted(p.grads), {"staleness": 0})  # type: ignore[misc]
                )

    # -- replies ----------------------------------------------------------------------
    def _send_released(self, released: list[tuple[str, tuple[bytes, Any, list[int]]]]) -> None:
        for _, (identity, rid, chunks) in released:
            self._after_backup(
                lambda i=identity, r=rid, c=chunks: self._reply_params(i, r, c, {"staleness": 0})  # type: ignore[misc]
            )

    def _reply_params(
        self, identity: bytes, rid: Any, chunks: list[int], extra: dict[str, Any]
    ) -> None:
        meta: dict[str, Any] = {"rid": rid, "done": self.done, **extra}
        tensors: dict[str, torch.Tensor] = {}
        pull = self._pull_of.get(identity)
        if pull is None:
            # Clones: the send may be zero-copy and the next update mutates the parameters.
            tensors = {f"c{idx}": self._params[idx].clone() for idx in chunks}
        else:
            sender, spec = pull
            encoder = self._pull_encoders[spec]
            compressed: dict[str, Any] = {}
            for idx in chunks:
                current = self._params[idx]
                view = self._views.get((sender, idx))
                if view is None:  # first contact: full values, and they become the view
                    tensors[f"c{idx}"] = current.clone()
                    self._views[(sender, idx)] = current.clone()
                    continue
                wire, cmeta = encoder.encode(idx, current - view)
                # Track exactly what the worker will hold: what the codec dropped stays in
                # the next difference (error feedback through the view).
                view.add_(encoder.decode(idx, wire, cmeta))
                tensors.update(wire)
                compressed[str(idx)] = cmeta
            if compressed:
                meta["pull_compression"] = compressed
                meta["codec"] = spec
        self.raw_bytes_out += sum(4 * self._chunks[idx].numel for idx in chunks)
        self._reply(identity, "PARAMS", meta, tensors)

    def _reply(
        self,
        identity: bytes,
        op: str,
        meta: dict[str, Any],
        tensors: dict[str, torch.Tensor] | None = None,
    ) -> None:
        msg = Message(
            op=op,
            experiment=self.config.experiment,
            shard=self.config.shard,
            version=self._version,
            sender=f"shard-{self.config.shard}",
            meta=meta,
            tensors=tensors or {},
        )
        frames = encode(msg)
        self.bytes_out += frames_nbytes(frames)
        assert self._sock is not None
        self._sock.send_multipart([identity, *frames], copy=False)

    def _reply_error(self, identity: bytes, rid: Any, message: str, code: str) -> None:
        self.errors += 1
        logger.warning("shard %d: rejected a request: %s (%s)", self.config.shard, message, code)
        if not isinstance(rid, int | str | None) or isinstance(rid, bool):
            rid = None
        try:
            self._reply(identity, "ERROR", {"rid": rid, "error": message, "code": code})
        except zmq.ZMQError as e:
            logger.warning("shard %d: could not send an error reply: %s", self.config.shard, e)


_ENV: dict[str, Any] = {}


def _environment() -> dict[str, Any]:
    """This process's environment fingerprint, stored with each shard checkpoint (computed once)."""
    if not _ENV:
        from gossamer.envinfo import fingerprint

        _ENV.update(fingerprint())
    return _ENV


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    def clone(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clone(v) for v in x]
        return x

    return clone(state)
