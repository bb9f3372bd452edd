"""One parameter-server shard: the facade over its state, apply rule, replication, pull views and serve loop.

The pieces, one module each: `_state` (chunk values, optimizer, version, export/import),
`_updates` (gathering pushes, the sync barrier or the SSP gate, applying), `_replication`
(primary -> backup SYNC/REPLICATE, backup attach/detach), `_pull_views` (per-sender
references for pull compression), `_replies` and `_serve` (the ROUTER loop and the dispatch
of each op). See `_replication` for what an acknowledged update guarantees.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from gossamer.checkpoint.sharded import ShardSnapshot
from gossamer.core.protocol import SyncMeta, chunk_key, parse_chunk_key
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver._pull_views import PullViews
from gossamer.paramserver._push_decoding import PushDecoders
from gossamer.paramserver._replication import Replication
from gossamer.paramserver._replies import Replies
from gossamer.paramserver._seeding import Rebuilt, Seed, Seeding
from gossamer.paramserver._serve import OVER_BUDGET, ServeLoop
from gossamer.paramserver._snapshot import PendingSnapshot
from gossamer.paramserver._state import ShardState
from gossamer.paramserver._updates import Updates
from gossamer.paramserver.shard_config import ShardConfig
from gossamer.security.curve import CurveKeyring
from gossamer.transport.frames import FrameLimits
from gossamer.transport.router import (
    FAILED_PRECONDITION,
    NOT_MEMBER,
    OVER_RATE,
    PEER_GONE,
    QUEUE_FULL,
    UNROUTABLE,
)

__all__ = ["Rebuilt", "ShardConfig", "ShardServer", "chunk_key", "parse_chunk_key"]

logger = logging.getLogger(__name__)


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
        own_init: bool = False,
        epoch: int = 0,
    ) -> None:
        """`shapes`: parameter shapes by name, so compressed segments decode as matrices;
        `backup`: start as the backup replica (promoted by `promote`); `curve`: serve with
        CurveZMQ, accepting only the keyring's members (and use it to reach the backup);
        `own_init`: the shard takes the `init` tensors (1-D fp32) as its values instead of
        copying them (the caller must not use them again); `epoch`: the coordinator's fencing
        epoch of the shard when this replica was assigned."""
        self.config = config
        self.plan = plan
        self._state = ShardState(config, plan, init, dict(shapes or {}), own_init=own_init)
        self.limits = config.limits or FrameLimits.for_values(plan.shard_numel(config.shard))
        self._lock = threading.RLock()  # re-entered: posted commands may call locking methods
        decoders = PushDecoders(self._state)
        self._replication = Replication(self._state, self.limits, curve, self._lock, decoders, backup=backup,
                                        epoch=epoch)
        self._views = PullViews(plan, self._state.shapes)
        self._replies = Replies(self._state, self._views, config.reply_budget, Counter(),
                                lambda: self._replication.epoch)
        self._updates = Updates(self._state, self._replies, self._replication, decoders)
        self._loop = ServeLoop(self._updates, self._replication, self._replies, limits=self.limits, curve=curve,
                               rate_limit=config.rate_limit, lock=self._lock, stats=self._stats)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.endpoint = ""
        self._snapshot_finish: PendingSnapshot | None = None  # the newest snapshot_later's
        self._finish_s = 0.0
        # Pieces (a chunk's values or one optimizer buffer) of the snapshots before the newest: written from
        # the live state / left to the snapshot by an update that wrote them out of place (new memory, no copy).
        self._snapshot_chunks = {"copied": 0, "adopted": 0}
        #: Called (serve thread) when a rebuild from the workers' copies ends: from which copy, and the
        #: versions lost (sender "" and version 0: no copy came before the deadline).
        self.on_seeded: Callable[[Rebuilt], None] | None = None
        self._loop.periodic.append(self._check_seeding)

    # -- lifecycle --------------------------------------------------------------------
    def bind(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Bind the ROUTER socket; returns ``tcp://host:port`` (the real port if 0)."""
        self.endpoint = self._loop.bind(host, port)
        logger.info("shard %d of %r serving %d chunks at %s", self.config.shard, self.config.experiment,
                    len(self._state.chunks), self.endpoint)
        return self.endpoint

    def start(self) -> threading.Thread:
        """Run `serve` in a daemon thread (binding to a random loopback port if needed)."""
        if self._loop.router is None:
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
        self._loop.close()

    def serve(self, stop: threading.Event) -> None:
        """The single-threaded poll loop; returns when `stop` is set. The thread running it
        owns the shard's sockets; an exception that ends it is kept in `serve_failure`."""
        self._loop.serve(stop)

    @property
    def serve_failure(self) -> BaseException | None:
        """Why the serve loop died (None: it runs, or returned on its stop event)."""
        return self._loop.failure

    # -- commands from other threads (role process: assignment updates) ------------------
    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the serve thread (under the lock) at the next loop iteration."""
        self._loop.post(fn)

    def set_members(self, senders: list[str], generation: int | None = None) -> None:
        """The coordinator's current workers: anyone else is gone (kill -9, lost lease).

        Their SSP waits are released at once and their half-received updates discarded. In
        sync mode a newer `generation` re-forms the barrier: contributions to the current
        step are refused with REFORM and redone by the survivors over the new membership.
        """
        self._updates.set_members(senders, generation, time.monotonic())

    def promote(self, reason: str = "promoted by the coordinator", epoch: int | None = None) -> bool:
        """Become the primary at fencing `epoch` (None: the next), serving workers and taking checkpoints.

        A backup refuses an epoch not newer than its own (returns False): a stale or repeated
        word of the coordinator promotes nobody.
        """
        return self._replication.promote(reason, epoch)

    @property
    def epoch(self) -> int:
        """The shard's fencing epoch this replica follows."""
        return self._replication.epoch

    def set_sender_key(self, key: str) -> None:
        """Check every worker's sender token (and the primary's, on replication) under `key`."""
        self._replication.sender_key = key

    def renew_lease(self, until: float) -> None:
        """The node's lease holds until `until` (time.monotonic); past it this replica acknowledges nothing.

        `until` 0 revokes it for good (the agent is gone, or the coordinator counted the node
        lost): renewals after that are ignored, since the shard may be primary elsewhere now.
        """
        if self._replication.lease_until != 0.0:
            self._replication.lease_until = until

    # -- replication ------------------------------------------------------------------
    @property
    def is_primary(self) -> bool:
        return self._replication.is_primary

    @property
    def replicated(self) -> bool:
        """True once a backup is attached and synced (acknowledged updates are on two replicas)."""
        return self._replication.replicated

    @property
    def backup_endpoint(self) -> str:
        return self._replication.backup_endpoint

    def set_backup(self, endpoint: str) -> None:
        """Attach (or with "" detach) the backup at `endpoint`; it first gets a full SYNC."""
        self._replication.set_backup(endpoint)

    # -- checkpoints ------------------------------------------------------------------
    @property
    def on_snapshot(self) -> Callable[[int], None] | None:
        """Called with the version at checkpoint boundaries (on the primary, on the serve thread)."""
        return self._updates.on_snapshot

    @on_snapshot.setter
    def on_snapshot(self, fn: Callable[[int], None] | None) -> None:
        self._updates.on_snapshot = fn

    def snapshot(self, step: int) -> ShardSnapshot:
        """This shard's state for a sharded checkpoint (copies; call on the serve thread)."""
        return self._state.snapshot(step)

    def snapshot_later(self, step: int, deliver: Callable[[ShardSnapshot], object]) -> PendingSnapshot:
        """This version's state for a checkpoint, handed to `deliver` (a writer, e.g.
        `AsyncCheckpointer.submit`) at once, with nothing copied.

        Call on the serve thread (under the lock). The snapshot streams the live tensors to its
        writer, which releases each one once written; updates meanwhile write what it has not
        written yet out of place, or wait for the writer past a small budget (`PendingSnapshot`).
        `deliver` returning False (it will not write it) or raising closes the snapshot.
        Returns the pending snapshot.
        """
        pending = self._state.open_snapshot(step)
        if self._snapshot_finish is not None:
            self._note_snapshot(self._snapshot_finish)
        self._snapshot_finish = pending
        taken = False
        try:
            taken = deliver(pending.snapshot) is not False
        finally:
            if not taken:
                pending.close()
        return pending

    def _note_snapshot(self, pending: PendingSnapshot) -> None:
        self._finish_s += pending.finish_seconds
        self._snapshot_chunks["copied"] += pending.pieces_in_place
        self._snapshot_chunks["adopted"] += pending.pieces_aside

    @property
    def snapshot_serve_seconds(self) -> float:
        """Time the serve thread spent for snapshots (all so far): waiting for the writer to write
        a piece an update reached past the snapshot's budget of writes aside, and copies for
        writes with no out-of-place twin (none of torch's SGD/AdamW or DelayedNesterov's)."""
        with self._lock:
            return self._finish_s + (self._snapshot_finish.finish_seconds if self._snapshot_finish else 0.0)

    def restore(self, step_dir: str) -> int:
        """Load this shard's chunks from a sharded checkpoint (any number of shards saved it).

        Returns the restored version. Raises CheckpointError if the checkpoint fails its checks.
        """
        meta, tensors = self._state.read_checkpoint(step_dir)
        with self._lock:
            # Updates half-gathered for the old state are void: their workers pull and redo.
            self._updates.void_waiting(f"shard {self.config.shard} rolled back to a checkpoint; pull and redo "
                                       "the step", FAILED_PRECONDITION, "rolled_back")
            self._replication.load(meta, tensors)
            self._views.clear()
            self._updates.restored(meta.applied)
        logger.warning("shard %d restored from %s at version %d", self.config.shard, step_dir, self.version)
        return self.version

    def await_seed(self, window_s: float = 2.0, deadline_s: float = 60.0) -> None:
        """Rebuild from the freshest worker's copy (every replica lost, no checkpoint): refuse PULL and
        PUSH with SEEDING until a copy is taken, `window_s` after the first complete one (or once every
        member sent one); `on_seeded` says which, or that none came within `deadline_s`."""
        with self._lock:
            self._loop.seeding = Seeding({i: c.numel for i, c in self._state.chunks.items()},
                                         started=time.monotonic(), window_s=window_s, deadline_s=deadline_s)

    def _check_seeding(self, now: float) -> None:
        seeding = self._loop.seeding
        if seeding is None:
            return
        seed = seeding.choice(now, self._updates.members)
        if seed is None and not seeding.expired(now):
            return
        self._loop.seeding = None
        rebuilt = Rebuilt("", 0)
        if seed is None:
            logger.error("shard %d: no worker sent its copy within %.0f s: nothing to rebuild from",
                         self.config.shard, seeding.deadline_s)
        else:
            self._updates.void_waiting(f"shard {self.config.shard} rebuilt from a worker's copy; pull and redo",
                                       FAILED_PRECONDITION, "rolled_back")
            meta = SyncMeta(state_version=seed.version, applied=dict(seed.applied or {}), scalars={})
            self._replication.load(meta, {chunk_key(i): t for i, t in seed.values.items()})
            self._views.clear()
            rebuilt = self._rebuilt(seeding, seed)
            logger.warning("shard %d rebuilt from %s's copy at version %d (of %d copies; optimizer state starts "
                           "afresh): %d version(s) lost%s", self.config.shard, seed.sender, seed.version,
                           len(seeding.seeds), rebuilt.lost, f" so far ({rebuilt.unknown})" if rebuilt.unknown else "")
        if self.on_seeded is not None:
            self.on_seeded(rebuilt)

    def _rebuilt(self, seeding: Seeding, seed: Seed) -> Rebuilt:
        """Count the versions lost with the copy taken: exactly for every worker that sent a copy (async);
        the others' as they push again (`Updates.restored`)."""
        lost = seeding.lost(seed) if not self.config.barrier else None
        if lost is None:
            self._updates.restored(dict(seed.applied or {}))
            why = ("sync: each worker redoes the steps from the copy's" if self.config.barrier
                   else "a copy came without its workers' clocks")
            return Rebuilt(seed.sender, seed.version, 0, f"{why}; counted as workers push again")
        self._updates.restored(dict(seed.applied or {}), lost)
        silent = sorted((self._updates.members or frozenset()) - set(lost))
        unknown = (f"{len(silent)} worker(s) sent no copy ({', '.join(silent[:4])}); their updates lost are "
                   "counted as they push again") if silent else ""
        return Rebuilt(seed.sender, seed.version, sum(lost.values()), unknown)

    def _apply(self, grads: dict[int, torch.Tensor], lr_factor: float,
               applied: list[tuple[str, int]] | None = None) -> None:
        """Apply an update as the serve loop does (call under `_lock`); `applied` None: a replay."""
        if applied is None:
            self._state.step(grads, lr_factor, schedule=False)
        else:
            self._updates.apply(grads, lr_factor, applied)

    # -- state ------------------------------------------------------------------------
    @property
    def decode_seconds(self) -> float:
        """Time spent decompressing pushes (all codecs)."""
        with self._lock:
            return self._updates.decode_seconds

    @property
    def version(self) -> int:
        return self._state.version

    @property
    def done(self) -> bool:
        return self._state.done

    @property
    def seeding(self) -> bool:
        """Waiting for the workers' copies (`await_seed`): the values and version are not the shard's yet."""
        return self._loop.seeding is not None

    @property
    def updates(self) -> int:
        return self._state.updates

    @property
    def errors(self) -> int:
        return self._replies.errors

    @property
    def discarded(self) -> Counter[str]:
        """Updates not applied, by cause."""
        return self._updates.discarded

    def values(self) -> dict[int, torch.Tensor]:
        """Copies of this shard's chunk values, by chunk index."""
        with self._lock:
            return {idx: p.clone() for idx, p in self._state.params.items()}

    def state_dict(self) -> dict[str, Any]:
        """Chunk values, optimizer state and version, for checkpointing."""
        with self._lock:
            return self._state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (same plan and shard)."""
        with self._lock:
            self._state.load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        """Counters and histograms (the STATS reply's meta)."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        gate = self._updates.gate
        hist = gate.stats()
        rep = self._replication
        refused = self._loop.refused
        last = self._snapshot_finish
        return {
            "experiment": self.config.experiment,
            "shard": self.config.shard,
            "mode": self.config.mode,
            "version": self.version,
            # A train function's sync: a version is an exchange, the run's progress is its optimizer steps.
            **({"steps": self._state.steps} if self.config.reduce else {}),
            "done": self.done,
            "updates": self.updates,
            "apply_s": self._state.apply_s,
            "cow_copies": self._state.cow_copies,
            "cow_s": self._state.cow_s,
            "snapshot_chunks_copied": self._snapshot_chunks["copied"] + (last.pieces_in_place if last else 0),
            "snapshot_chunks_adopted": self._snapshot_chunks["adopted"] + (last.pieces_aside if last else 0),
            "staleness": hist["staleness"],
            "version_staleness": hist["version_staleness"],
            "waits": hist["waits"],
            "wait_seconds": hist["wait_seconds"],
            "clocks": hist["clocks"],
            "active": hist["active"],
            "stragglers": hist["stragglers"],
            "straggler_updates": hist["straggler_updates"],
            "held": gate.held_count(),
            "bytes_in": self._loop.bytes_in,
            "bytes_out": self._replies.bytes_out + rep.bytes_out,
            "raw_bytes_out": self._replies.raw_bytes_out,
            "errors": self.errors,
            "dropped": refused[UNROUTABLE],
            "discarded": dict(self.discarded),
            "primary": rep.is_primary,
            "replicated": rep.replicated,
            "unreplicated": rep.unreplicated,
            "backup_detaches": rep.backup_detaches,
            "resyncs": rep.resyncs,
            "sync_parts_in": rep.sync_parts_in,
            "streamed_answers": self._updates.streamed_answers,
            "regathered": self._updates.regathered,
            "replicated_updates": rep.replicated_updates,
            "replicated_encoded": rep.replicated_encoded,
            "replicate_window_waits": rep.window_waits,
            "replicate_bytes": rep.bytes_out,
            "promotions": rep.promotions,
            "refused_promotions": rep.refused_promotions,
            "epoch": rep.epoch,
            "fenced": rep.fenced,
            "fenced_replies": rep.fenced_replies,
            "generation": self._updates.generation,
            "applied": dict(self._state.applied),
            "versions_lost": self._updates.versions_lost,
            "rate_limited": refused[OVER_RATE],
            "not_member": refused[NOT_MEMBER],
            "curve_refused": self._loop.curve_refused,
            "queue_full": refused[QUEUE_FULL],
            "peer_gone": refused[PEER_GONE],
            "over_budget": refused[OVER_BUDGET],
            "budget_waits": self._loop.budget_waits.waited,
            "budget_waits_refused": self._loop.budget_waits.refused_after_wait,
            "held_replies": self._replies.outgoing.held_replies(),
            "held_reply_bytes": self._replies.outgoing.held_bytes(self._replies.live_storages()),
            "reply_budget_bytes": self._replies.outgoing.max_bytes,
            "pull_views": self._views.senders(),
            "gathering": self._updates.gathering,
            **self._loop.credits.stats(),
            "push_deferrals": self._loop.deferred_pushes,
        }
