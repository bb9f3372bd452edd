"""A shard's apply rule: gather each worker's update from its PUSH parts, then apply it on arrival
(async, bounded by the SSP gate) or once every current worker's is in (sync, a barrier per step)."""

from __future__ import annotations

import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gossamer.core.errors import ProtocolError
from gossamer.core.faults import die_at
from gossamer.core.protocol import PushCompression, PushMeta
from gossamer.paramserver._push_decoding import EncodedPart, PushDecoders, accumulate
from gossamer.paramserver._reject import Reject
from gossamer.paramserver._replication import Replication
from gossamer.paramserver._replies import Replies
from gossamer.paramserver._state import ShardState
from gossamer.paramserver.consistency import SSPGate
from gossamer.paramserver.push_parts import SYNC_PUSH_PART_BYTES
from gossamer.transport.frames import Message, check_finite
from gossamer.transport.router import ABORTED, FAILED_PRECONDITION, NOT_A_WORKER, REFORM

__all__ = ["Updates"]

logger = logging.getLogger(__name__)

#: Updates one worker may have half-gathered at once: the one it sends and one it gave up on (a
#: part lost, the update sent again under a new clock). Starting a third aborts its oldest, so a
#: worker holds at most this many times the shard's gradients in parts.
GATHERING_PER_SENDER = 2

#: Requests (connection, request id) whose update was aborted, remembered so that the fragments of theirs
#: still on the way are refused rather than gathered into an update that cannot complete.
_VOID_REQUESTS = 64

#: What a held (SSP-waiting) reply needs: ZMQ identity, request id, chunks.
Held = tuple[bytes, Any, list[int]]


@dataclass
class _Part:
    """One PUSH message of an update (a local rank's slice)."""

    identity: bytes
    rid: Any
    basis: int
    #: Its dense chunk gradients until they are added into the update's sum (`take`).
    grads: dict[int, torch.Tensor]
    #: The push's compressed payload, kept to forward to the backup only while it is smaller than
    #: `grads` (None: an uncompressed push, or one no smaller than its gradients).
    encoded: EncodedPart | None = None
    #: The chunks it covers (its reply's), kept once `grads` is handed over ([]: those of `grads`).
    chunks: list[int] = field(default_factory=list)
    #: Answered without values (PUSH meta "reply": "ack"): the worker pulls them after, a part at a time.
    ack: bool = False
    #: Answered already: a sync part with more to come (PUSH meta "more"), acknowledged once in the step's sum.
    answered: bool = False

    def __post_init__(self) -> None:
        self.chunks = sorted(self.chunks or self.grads)

    @property
    def reply_chunks(self) -> list[int]:
        """The chunks whose values its PARAMS reply carries (none for an ack)."""
        return [] if self.ack else self.chunks

    def add_to(self, total: dict[int, torch.Tensor], decoders: PushDecoders) -> None:
        """Add its gradient into `total`: its dense gradients (`take`), or a push held only
        encoded decoded again, chunk by chunk (decoders are stateless: the bits it was checked with)."""
        if self.grads or self.encoded is None:
            accumulate(total, self.take())
        else:
            decoders.decode_into(total, self.encoded)

    def take(self) -> dict[int, torch.Tensor]:
        """Hand over the gradients to be added up: the part keeps no reference to them, so a
        buffer added into the sum is freed at once, not held (a copy of the shard per worker)
        until the reply that waits on the backup."""
        grads, self.grads = self.grads, {}
        return grads


@dataclass
class _Update:
    """The parts received so far of one worker's update for one clock (or step)."""

    sender: str
    key: int = 0  # the worker's clock (async) or step (sync)
    parts: list[_Part] = field(default_factory=list)
    covered: set[int] = field(default_factory=set)
    #: Sync: some of its dense gradients are in the step's sum already (it cannot be dropped alone).
    summed: bool = False
    #: Sync parts in order (PUSH meta "part"): the part each connection sends next.
    next_part: dict[bytes, int] = field(default_factory=dict)
    #: The sender's clock its pushes said (a train function's sync: its optimizer steps).
    clock: int = 0
    #: Its pushes said the sender is done (`PushMeta.idle`): it holds its place, its gradient is left out.
    idle: bool = False

    def unanswered(self) -> list[_Part]:
        """Its parts still waiting for an answer."""
        return [p for p in self.parts if not p.answered]


class Updates:
    """Validates pushes, gathers their parts into updates and applies them (under the shard's lock)."""

    def __init__(self, state: ShardState, replies: Replies, replication: Replication,
                 decoders: PushDecoders) -> None:
        config = state.config
        self.state = state
        self.config = config
        self.replies = replies
        self.replication = replication
        self.gate: SSPGate[Held] = SSPGate(
            None if config.barrier else config.staleness,
            lr_staleness_scaling=config.lr_staleness_scaling,
            staleness_in_rounds=config.staleness_in_rounds,
            worker_timeout_s=config.worker_timeout_s,
            wait_for_stragglers=config.wait_for_stragglers,
        )
        self.decoders = decoders
        self._pending: dict[tuple[str, int], _Update] = {}
        self._sync_step: dict[str, _Update] = {}
        #: The step's sum of the dense gradients received so far, each added as it arrives (sync).
        self._step_sum: dict[int, torch.Tensor] = {}
        #: Sync: a whole dense push is added into the step's sum as it arrives only on a shard this large; on a
        #: smaller one it is held until the step (`_sum_on_arrival`).
        self._sum_whole_on_arrival = 4 * sum(c.numel for c in state.chunks.values()) >= SYNC_PUSH_PART_BYTES
        self._sync_num_workers: int | None = None
        self.generation = 0  # of the sync barrier's membership
        # Every update not applied, by cause (rejected, nonfinite, aborted, duplicate,
        # partial, reform, wrong_step, rolled_back); reported to the coordinator.
        self.discarded: Counter[str] = Counter()
        # After a restore from a checkpoint: what each worker had applied then. A worker's first
        # push afterwards shows how many of its updates the restore rolled back.
        self._restored_applied: dict[str, int] | None = None
        self._seen_since_restore: set[str] = set()
        self.versions_lost = 0
        #: Answers to the parts of an update sent as soon as their chunks were stepped (the rest of it still stepping).
        self.streamed_answers = 0
        #: Updates gathered afresh: a request's fragments sent again (resent whole after one was refused).
        self.regathered = 0
        self._void_requests: OrderedDict[tuple[bytes, Any], None] = OrderedDict()
        self.on_snapshot: Callable[[int], None] | None = None  # called at checkpoint boundaries
        #: The coordinator's current workers (`set_members`); None: never told (a shard run alone).
        self.members: frozenset[str] | None = None
        #: `ShardConfig.reduce`: the last round (its version before) and its mean, for a push of it sent again.
        self._last_mean: tuple[int, dict[int, torch.Tensor]] | None = None

    @property
    def decode_seconds(self) -> float:
        """Time spent decompressing pushes (all codecs)."""
        return self.decoders.decode_seconds

    # -- applying -------------------------------------------------------------------------
    def apply(self, grads: dict[int, torch.Tensor] | None, lr_factor: float, applied: list[tuple[str, int]],
              *, delay: int = 0, encoded: list[EncodedPart] | None = None, groups: list[list[int]] | None = None,
              after_group: Callable[[list[int]], None] | None = None) -> None:
        """Apply an update covering `applied` (worker, clock or step), replicate it, checkpoint if due.

        `delay`: Delayed Nesterov's N (async: the active workers; 0 keeps it). `encoded`: the
        compressed pushes `grads` was decoded and added up from, in that order (None: not all
        of them were), for the backup to do the same. `grads` None: `encoded` alone holds the
        update, decoded again a group of chunks at a time into the step (never the dense sum).
        `groups`, `after_group`: `grads` stepped these chunks at a time, `after_group` called after each
        (`ShardState.step`).
        """
        if delay:
            self.state.set_delay(delay)
        if grads is None:
            assert encoded is not None
            by_group = functools.partial(self.decoders.summed, encoded)
            factor = self.state.step(by_group, lr_factor, schedule=True)
            self.state.remember(applied, latest=False)
            self.replication.replicate(lambda: by_group(sorted(self.state.chunks)), factor, applied, delay=delay,
                                       encoded=encoded)
        else:
            factor = self.state.step(grads, lr_factor, schedule=True, groups=groups, after_group=after_group)
            self.state.remember(applied, latest=False)
            self.replication.replicate(grads, factor, applied, delay=delay, encoded=encoded)
        self._applied()

    def _applied(self) -> None:
        """A version was made: the fault point after it, and the checkpoint if one is due."""
        version = self.state.version
        die_at("after-apply", step=version, shard=self.config.shard)
        every = self.config.checkpoint_every
        if self.replication.is_primary and every and version % every == 0 and self.on_snapshot is not None:
            self.on_snapshot(version)

    def _linear(self, num_workers: int) -> float:
        return 1.0 if self.config.lr_linear is None else self.config.lr_linear(num_workers)

    def _reply_later(self, part: _Part, *, staleness: int = 0, lead: int | None = None, counted: bool = True) -> None:
        self.replication.after_backup(
            lambda: self.replies.params(part.identity, part.rid, part.reply_chunks, staleness=staleness,
                                       lead=lead, counted=counted)
        )

    def send_released(self, released: list[tuple[str, Held]]) -> None:
        """Answer the pushes the SSP gate held and has now released."""
        for _, (identity, rid, chunks) in released:
            self.replication.after_backup(
                lambda i=identity, r=rid, c=chunks: self.replies.params(i, r, c, staleness=0)  # type: ignore[misc]
            )

    @property
    def gathering(self) -> int:
        """Updates with some parts received and others still missing."""
        return len(self._pending)

    # -- who may cost the shard memory ------------------------------------------------------------
    def is_member(self, sender: str) -> bool:
        """`sender` is one of the coordinator's current workers (any sender before it named them)."""
        return bool(sender) and (self.members is None or sender in self.members)

    def may_keep_view(self, sender: str) -> bool:
        """A pull view (up to a copy of the shard) may be kept for `sender`: a current member
        that this shard knows (it said HELLO, pushed or pulled, and has not expired or left)."""
        return self.is_member(sender) and sender in self.gate.active

    # -- PUSH ------------------------------------------------------------------------------
    def on_push(self, identity: bytes, msg: Message, now: float) -> None:
        rid = msg.meta.get("rid")
        sync = self.config.barrier
        sender = msg.sender
        if not sender:
            raise Reject("PUSH needs a sender id")
        if not self.is_member(sender):
            # Checked before anything is decoded or gathered: parts are held only for the
            # coordinator's current workers (a sender it never named would be held until it expired).
            raise Reject(f"PUSH from {sender!r} refused: not a current worker of experiment {self.config.experiment!r} "
                         "at this shard; nothing of it is kept", NOT_A_WORKER, cause="not_member")
        meta = PushMeta.from_meta(msg.meta, barrier=sync)
        self.replies.views.note_codec(identity, sender, meta.pull_codec, keep_view=self.may_keep_view(sender))
        step = meta.step or 0
        key = (sender, step if sync else meta.clock)
        if not sync and isinstance(rid, int | str) and (identity, rid) in self._void_requests:
            raise Reject(f"PUSH fragment of request {rid!r} refused: its update was aborted; nothing of it is kept",
                         ABORTED, cause="aborted")
        try:
            grads, encoded, chunks = self._validate_grads(msg)
        except (Reject, ProtocolError) as e:
            # One bad part spoils the whole update: never apply the other parts alone.
            self._abort(key, f"another part was rejected: {e}")
            self._void(identity, rid)
            raise
        self.gate.touch(sender, now)
        if not sync:
            self._note_restore_loss(sender, meta.clock)
        part = _Part(identity=identity, rid=rid, basis=meta.basis, grads=grads, encoded=encoded, chunks=chunks,
                     ack=not meta.values)
        del grads  # the part owns them: added into the sum, they are freed (this frame may outlive the step)
        if key[1] <= self.state.applied.get(sender, -1):
            # A retry (after a failover) of an update this shard already applied.
            self.discarded["duplicate"] += 1
            part.take()  # nothing of it is applied: only its reply waits
            if self.config.reduce:
                self._answer_round_again(part, key[1])
                return
            self._reply_later(part, counted=not meta.more)  # a fragment's: one reply held for all of them
            return
        if self.state.done:
            self.replies.params(identity, rid, part.reply_chunks, staleness=0, counted=not meta.more)
            return
        if sync:
            self._check_generation(meta.generation or 0)
            if step != self.state.version:
                raise Reject(f"sync push for step {step} but the shard is at step {self.state.version}",
                             FAILED_PRECONDITION, cause="wrong_step")
        self._gather(key, part, meta, now)

    def _answer_round_again(self, part: _Part, step: int) -> None:
        """A train function's sync push to a round this shard made already (its reply lost): that round's mean,
        if it was the last one; an older round's is gone, and the worker is told to give its exchange up."""
        if self._last_mean is None or self._last_mean[0] != step:
            raise Reject(f"round {step}'s mean is no longer held (the shard is at {self.state.version})",
                         FAILED_PRECONDITION, cause="wrong_step")
        self._answer_mean([part], [part])

    def _note_restore_loss(self, sender: str, clock: int) -> None:
        if self._restored_applied is None or sender in self._seen_since_restore:
            return
        self._seen_since_restore.add(sender)
        lost = max(0, clock - 1 - self._restored_applied.get(sender, -1))
        if lost:
            logger.warning("shard %d: %d update(s) of %s were lost with the restore", self.config.shard, lost, sender)
            self.versions_lost += lost

    def _gather(self, key: tuple[str, int], part: _Part, meta: PushMeta, now: float) -> None:
        sync = self.config.barrier
        update = self._pending.get(key)
        if sync:
            self._admit_sync(key, update, part, meta)
        if update is None:
            mine = [k for k in self._pending if k[0] == key[0]]
            if len(mine) >= GATHERING_PER_SENDER:
                self._abort(mine[0], f"{key[0]} started update {key[1]} with {len(mine)} others still incomplete")
            update = self._pending[key] = _Update(sender=key[0], key=key[1])
        overlap = update.covered.intersection(part.chunks)
        if overlap and not sync and any(p.identity == part.identity and p.rid == part.rid for p in update.parts):
            # The same request's fragments sent again (a refused fragment is resent with all the others): what came
            # of the first sending is dropped (another local rank's parts stay), and the update is gathered afresh.
            kept = [p for p in update.parts if p.identity != part.identity or p.rid != part.rid]
            update = self._pending[key] = _Update(sender=key[0], key=key[1], parts=kept,
                                                  covered={i for p in kept for i in p.chunks})
            self.regathered += 1
            overlap = update.covered.intersection(part.chunks)
        if overlap:
            # A duplicated chunk means the update is inconsistent: drop all of it.
            self._abort(key, f"chunks {sorted(overlap)[:8]} pushed twice for one update")
            raise Reject(f"chunks {sorted(overlap)[:8]} pushed twice for one update")
        if meta.more and len(update.covered) + len(part.chunks) >= len(self.state.chunks):
            self._abort(key, "a part that says more follow covers the rest of the update")
            raise Reject("PUSH meta 'more': this part covers the rest of the update, so none may follow")
        update.parts.append(part)
        update.covered.update(part.chunks)
        update.clock = meta.clock
        update.idle = meta.idle
        if sync:
            self._sum_on_arrival(update, part, meta)
        if len(update.covered) < len(self.state.chunks):
            return
        del self._pending[key]
        if sync:
            self._on_sync_contribution(update, meta.num_workers or 1, now)
        else:
            self._apply_async(update, now)

    def _admit_sync(self, key: tuple[str, int], update: _Update | None, part: _Part, meta: PushMeta) -> None:
        """Refuse a sync part before anything of it is added into the step's sum (which cannot give it back):
        a sender that contributed to the step already, another worker count, a sender beyond the step's
        workers, or a part whose connection's earlier parts are not here (dropped with a voided step)."""
        sender, step = key
        num_workers = meta.num_workers or 1
        if sender in self._sync_step:
            raise Reject(f"{sender!r} already contributed to step {step}", FAILED_PRECONDITION, cause="rejected")
        if self._sync_num_workers is not None and num_workers != self._sync_num_workers:
            raise Reject(f"num_workers {num_workers} != {self._sync_num_workers} for this step", FAILED_PRECONDITION,
                         cause="rejected")
        senders = set(self._sync_step) | {k[0] for k in self._pending}
        if sender not in senders and len(senders) >= num_workers:
            raise Reject(f"step {step} has the updates of its {num_workers} worker(s) coming already",
                         FAILED_PRECONDITION, cause="rejected")
        expected = 0 if update is None else update.next_part.get(part.identity, 0)
        if meta.part is not None and meta.part != expected:
            why = (f"part {meta.part} of {sender!r}'s update to step {step} came after part {expected - 1}"
                   if expected else f"the parts of {sender!r}'s update to step {step} before part {meta.part} "
                   "were dropped (the step is redone)")
            if update is not None:
                self._abort(key, why)
            raise Reject(f"{why}; pull and redo the step", FAILED_PRECONDITION, cause="partial")
        if self._sync_num_workers is None:
            self._sync_num_workers = num_workers

    def _sum_on_arrival(self, update: _Update, part: _Part, meta: PushMeta) -> None:
        """Add a large sync push's dense gradients into the step's sum now (the shard holds the sum and the
        part being read, not every worker's push until the last is in), and acknowledge a part that says more
        follow.

        Added on arrival, so in arrival order: a push in parts, and any push to a shard whose gradient is
        `SYNC_PUSH_PART_BYTES` or more. Two workers' sum has the same bits either way (IEEE addition is
        commutative); with three or more the last bits differ from run to run. On a smaller shard a whole push
        is held (under 16 MiB a worker) and added at the step in sender order (`_on_sync_contribution`), as a
        push held encoded is: the same bits every run, those of a step that held every push. Those last bits
        matter: ReLU training is chaotic enough that one can flip a unit and move the run 1e-3 from
        single-process training (test_sync_elastic failed 1 run in 15-45 with digits summed in arrival order).
        The backup gets the sum itself, so it holds the same bits either way."""
        if part.grads and not self.config.reduce and (meta.part is not None or self._sum_whole_on_arrival):
            accumulate(self._step_sum, part.take())
            update.summed = True
        if meta.part is not None:
            update.next_part[part.identity] = meta.part + 1
        if meta.more:
            part.answered = True
            self.replies.params(part.identity, part.rid, [], staleness=0)

    def _check_values_finite(self, pushed: dict[int, torch.Tensor]) -> None:
        """A train function's sync push: the values it carries become the run's, so they must be finite. Its
        gradient may not be: an fp16 step that overflowed (torch's GradScaler) goes into the round's mean, which
        is then not finite on every worker, so each worker's GradScaler skips the step alike, as with torch DDP.
        The shards never step on it (the workers do)."""
        for idx, t in pushed.items():
            values = t[self.state.chunks[idx].numel:]
            if not (bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())):
                raise Reject(f"chunk {idx}: the parameters pushed are not finite")

    def _validate_grads(self, msg: Message) -> tuple[dict[int, torch.Tensor], EncodedPart | None, list[int]]:
        """The push's dense chunk gradients, its compressed form if worth forwarding to the backup, and
        its chunks. A compressed push waiting for a sync step is checked (decoded chunk by chunk) and
        then held only encoded when that is smaller: each worker's dense copy is not kept until the step."""
        if not msg.tensors:
            raise Reject("PUSH carries no gradients")
        compression = PushCompression.from_meta(msg.meta)
        if compression is None:
            grads = self.decoders.dense(msg.tensors, "PUSH", per_chunk=2 if self.config.reduce else 1)
            if self.config.reduce:
                self._check_values_finite(grads)
            else:
                check_finite(msg)
            return grads, None, []
        if self.config.reduce:
            raise Reject("a train function's sync push carries plain gradients and values, never compressed ones")
        part = EncodedPart(compression, msg.tensors)
        if self.config.barrier:
            chunks = self.decoders.decode_into(None, part)
            if part.nbytes < sum(4 * self.state.chunks[idx].numel for idx in chunks):
                return {}, part, chunks
        grads = self.decoders.decode(part)
        # Kept (the payload's memory, until the update is applied) only while smaller than the gradients.
        smaller = part.nbytes < sum(4 * self.state.chunks[idx].numel for idx in grads)
        return grads, part if smaller else None, []

    # -- async: applied on arrival -----------------------------------------------------------
    def _apply_async(self, update: _Update, now: float) -> None:
        basis = min(p.basis for p in update.parts)
        record = self.gate.on_apply(update.sender, version=self.state.version, basis=basis, now=now)
        grads: dict[int, torch.Tensor] = {}
        for part in update.parts:
            part.add_to(grads, self.decoders)  # disjoint chunks: a union
        held = self.gate.must_wait(update.sender, now)
        answered: list[_Part] = []
        streams = not held and len(update.parts) > 1 and self.replication.answers_at_once
        # The answers to one connection's fragments count as one reply held for it (`ReplyBudget.per_peer`).
        last = {p.identity: k for k, p in enumerate(update.parts)}

        def answer(group: list[int]) -> None:
            # Each part is answered as soon as its chunks are stepped (the parts are the step's groups), while the
            # next group is stepped: its values are final, and say the version this step makes. The last part is
            # answered once the step is done (the shard at that version for whoever asks next).
            k = len(answered)
            if k == len(update.parts) - 1:
                return
            part = update.parts[k]
            answered.append(part)
            self.streamed_answers += 1
            self.replication.after_backup(
                lambda: self.replies.params(part.identity, part.rid, part.reply_chunks, lead=record.lead,
                                            staleness=record.version_staleness, version=self.state.version + 1,
                                            counted=last[part.identity] == k))

        self.apply(grads, record.lr_factor * self._linear(1), [(update.sender, update.key)],
                   delay=len(self.gate.active), encoded=_encoded([update]),
                   groups=[p.chunks for p in update.parts] if streams else None,
                   after_group=answer if streams else None)
        if held:
            for part in update.parts:
                self.gate.hold(update.sender, (part.identity, part.rid, part.reply_chunks), now)
        else:
            for k, part in enumerate(update.parts[len(answered):], start=len(answered)):
                self._reply_later(part, staleness=record.version_staleness, lead=record.lead,
                                  counted=last[part.identity] == k)
        self.send_released(self.gate.release(now))

    # -- sync: a barrier per step --------------------------------------------------------------
    def _on_sync_contribution(self, update: _Update, num_workers: int, now: float) -> None:
        # Admitted part by part (`_admit_sync`): a first contribution of this sender, at this worker count.
        self._sync_step[update.sender] = update
        if len(self._sync_step) < num_workers:
            return
        contributions = [self._sync_step[s] for s in sorted(self._sync_step)]
        dense_sum, self._step_sum = self._step_sum, {}
        self._sync_step = {}
        self._sync_num_workers = None
        if self.config.reduce:
            self._reduce(contributions, now)
            return
        encoded = _encoded(contributions)  # their payloads: the sum below writes decoded buffers only
        summed: dict[int, torch.Tensor] | None = None  # all held encoded: summed a group of chunks at a time
        if encoded is None:  # some push dense: add those held (small dense, encoded) in sender order
            summed = dense_sum
            for contrib in contributions:
                for part in contrib.parts:
                    part.add_to(summed, self.decoders)
        for contrib in contributions:
            self.gate.on_apply(contrib.sender, version=self.state.version, basis=self.state.version, now=now)
        self.apply(summed, self._linear(len(contributions)), [(c.sender, c.key) for c in contributions],
                   encoded=encoded)
        for contrib in contributions:
            for part in contrib.unanswered():
                self._reply_later(part)

    def _reduce(self, contributions: list[_Update], now: float) -> None:
        """A train function's sync round (`ShardConfig.reduce`): answer each worker with the mean of the round's
        gradients and hold the values the pushes carry as the next version (with the optimizer steps they are of).

        Summed in sender order, whatever order the pushes came in, so a round has the same bits every run and
        one worker's mean is its own gradient exactly. The values are the first sender's: every worker took the
        same optimizer steps on the same means, so theirs are the same (a worker that joined takes the run's
        values from the shard). The backup is sent the change of values, applied with SGD at lr 1 (the
        parameters to rounding; a round lost with its primary is redone by the workers).

        Workers that are done push idle (`PushMeta.idle`) for those still stepping (one that joined may be a step
        behind): the mean is of the others'. A round of idle pushes alone makes no version, which tells them all
        that every worker is done."""
        stepping = [c for c in contributions if not c.idle]
        if not stepping:
            self._last_mean = None
            for contrib in contributions:
                for part in contrib.parts:
                    part.take()
                for part in contrib.unanswered():
                    self.replication.after_backup(functools.partial(
                        self.replies.params, part.identity, part.rid, [], staleness=0))
            return
        total: dict[int, torch.Tensor] = {}
        values: dict[int, torch.Tensor] = {}
        for contrib in stepping:
            for part in contrib.parts:
                for idx, pushed in part.take().items():
                    n = self.state.chunks[idx].numel
                    if idx in total:
                        total[idx].add_(pushed[:n])
                    else:
                        total[idx] = pushed[:n].clone()
                    values.setdefault(idx, pushed[n:])
        mean = {idx: t.div_(len(stepping)) for idx, t in total.items()}
        for contrib in contributions:
            self.gate.on_apply(contrib.sender, version=self.state.version, basis=self.state.version, now=now)
        change = ({idx: self.state.params[idx] - v for idx, v in values.items()}
                  if self.replication.socket is not None else {})
        applied = [(c.sender, c.key) for c in contributions]
        self.state.assign(values, stepping[0].clock)
        self.state.remember(applied, latest=False)
        self.replication.replicate(change, 1.0, applied)
        self._last_mean = (self.state.version - 1, mean)
        self._applied()
        for contrib in contributions:
            self._answer_mean(contrib.parts, contrib.unanswered())

    def _answer_mean(self, parts: list[_Part], unanswered: list[_Part]) -> None:
        """Answer a worker's round with the round's mean, each connection with every chunk it pushed (its parts
        before the last were acknowledged only)."""
        assert self._last_mean is not None
        mean = self._last_mean[1]
        pushed: dict[bytes, list[int]] = {}
        for part in parts:
            pushed.setdefault(part.identity, []).extend(part.chunks)
        for part in unanswered:
            self.replication.after_backup(functools.partial(
                self.replies.params, part.identity, part.rid, sorted(pushed[part.identity]), staleness=0, values=mean))

    def _check_generation(self, gen: int) -> None:
        """Sync barrier membership: a newer generation re-forms it, an older one must redo."""
        if gen < self.generation:
            raise Reject(f"the barrier re-formed at generation {self.generation}; redo the step "
                         "with the new membership", REFORM, cause="reform")
        if gen > self.generation:
            self.reform(gen)

    def reform(self, gen: int) -> None:
        """Re-form the sync barrier at generation `gen`: contributions gathered so far are redone."""
        self.generation = gen
        waiting = len(self._sync_step) + len(self._pending)
        if waiting:
            logger.info("shard %d: barrier re-forms at generation %d; %d contribution(s) to step %d "
                        "must be redone", self.config.shard, gen, waiting, self.state.version)
        self.void_waiting(f"the barrier re-formed at generation {gen}; redo the step with the new membership",
                          REFORM, "reform")

    # -- what is being gathered ---------------------------------------------------------------
    def _abort(self, key: tuple[str, int], reason: str, code: str = ABORTED) -> None:
        update = self._pending.pop(key, None)
        if update is None:
            return
        if code == ABORTED:
            self.discarded["aborted"] += 1
        for part in update.unanswered():
            self.replies.error(part.identity, part.rid, f"update aborted: {reason}", code)
            self._void(part.identity, part.rid)
        if update.summed:
            # Its gradients are in the step's sum, which cannot give them back: the step is redone by all.
            self.void_waiting(f"step {self.state.version} is redone: {update.sender!r}'s update to it was "
                              f"dropped after parts of it were added into the step's sum ({reason}); pull and "
                              "redo the step", FAILED_PRECONDITION, "voided")
        elif self.config.barrier and not self._pending and not self._sync_step:
            self._sync_num_workers = None

    def _void(self, identity: bytes, rid: Any) -> None:
        """Refuse what else comes of request `rid` of `identity` (an async push's later fragments)."""
        if self.config.barrier or not isinstance(rid, int | str):
            return
        self._void_requests[(identity, rid)] = None
        while len(self._void_requests) > _VOID_REQUESTS:
            self._void_requests.popitem(last=False)

    def void_waiting(self, why: str, code: str, cause: str) -> None:
        """Refuse every update still being gathered (parts, sync contributions) and drop the step's sum;
        count each. A part answered already (more followed it) is not answered again: its connection's
        next part is refused, as the parts before it are gone."""
        pending, self._pending = self._pending, {}
        contributions, self._sync_step = self._sync_step, {}
        self._step_sum = {}
        self._sync_num_workers = None
        for update in pending.values():
            self.discarded[cause] += 1
            if code == ABORTED:
                self.discarded["aborted"] += 1
            for part in update.unanswered():
                self.replies.error(part.identity, part.rid, f"update aborted: {why}", code)
        for contrib in contributions.values():
            self.discarded[cause] += 1
            for part in contrib.unanswered():
                self.replies.error(part.identity, part.rid, why, code)

    def discard_pending_of(self, worker: str) -> None:
        for key in [k for k in self._pending if k[0] == worker]:
            self.discarded["partial"] += 1
            self._abort(key, f"worker {worker} left with its update incomplete")

    def restored(self, applied: dict[str, int], counted: Mapping[str, int] | None = None) -> None:
        """The state was rolled back to a checkpoint (or a worker's copy) holding `applied`; `counted`: the
        updates lost of the workers already counted (a copy's senders), not counted again at their next push."""
        self._restored_applied = dict(applied)
        self._seen_since_restore = set(counted or ())
        self.versions_lost += sum((counted or {}).values())

    # -- membership ---------------------------------------------------------------------------
    def set_members(self, senders: list[str], generation: int | None, now: float) -> None:
        if self.config.barrier and generation is not None and generation > self.generation:
            self.reform(generation)
        members = self.members = frozenset(senders)
        self.replies.views.retain(lambda sender: sender in members)  # a worker killed without LEAVE too
        for worker in self.gate.active:
            if worker not in members:
                logger.info("shard %d: worker %s is no longer a member", self.config.shard, worker)
                self.discard_pending_of(worker)
                self.send_released(self.gate.leave(worker, now))

    def leave(self, worker: str, now: float) -> None:
        self.replies.views.forget(worker)
        self.discard_pending_of(worker)
        self.send_released(self.gate.leave(worker, now))

    def expire(self, now: float) -> None:
        """Drop workers silent for `worker_timeout_s`; release whoever waited on them."""
        dead, released = self.gate.expire(now)
        for worker in dead:
            self.replies.views.forget(worker)
            self.discard_pending_of(worker)
        # Also whoever waited on a worker that has just turned suspect.
        self.send_released(released + self.gate.release(now))


def _encoded(updates: list[_Update]) -> list[EncodedPart] | None:
    """The compressed pushes of `updates` in the order they are added up, or None if any part has none."""
    parts = [part.encoded for update in updates for part in update.parts]
    if any(p is None for p in parts):
        return None
    return [p for p in parts if p is not None]
