"""Primary/backup replication of a shard: the primary forwards every applied update, the backup replays it.

A primary forwards every applied update (its gradient, the lr factor, Delayed Nesterov's N, and
which worker clocks it covers) to its backup, which applies the same optimizer step and so
holds bit-identical state. The gradient goes in the smaller of two exact forms: the compressed
pushes it was made of, as they arrived (the backup decodes them with the primary's decoders and
adds them up in the primary's order, `_push_decoding`), when every push of the update was
compressed and their message is smaller than the dense one and fits the frame limits; else the
dense fp32 gradient the primary applied (uncompressed pushes, a sync step whose workers' pushes
add up to more bytes than their sum, `ShardConfig.replicate_encoded` off). REPLICATEs go while those the backup
has not acknowledged yet stay within `REPLICATE_WINDOW_BYTES` (one always may): many small ones are on their way
at once, a dense update of a large shard one at a time, so the backup holds one such gradient beside its state,
not every one the primary applied meanwhile (ZMQ reads what arrives). A worker's PUSH is acknowledged (its reply sent) only once the
backup has acknowledged that version: an acknowledged update survives the loss of either
replica. A backup that does not answer for `backup_timeout_s`, or whose queue is full (it does
not keep up), is detached; the primary then acknowledges unreplicated (counted) and re-attaches
it with a full-state SYNC after a backoff (1 s, doubling to 30 s; reset once a SYNC is
acknowledged), until the coordinator names another backup. While a SYNC is on its way (it may
take long: the whole state) replies are not held for it, so it is never timed as a stall: they
are acknowledged unreplicated, and held again once the backup has acknowledged the SYNC.

Authority: a replica's `epoch` is the coordinator's fencing epoch of the shard. A backup
becomes primary only through `promote` with a newer epoch (the coordinator's word), and
accepts SYNC/REPLICATE only from the shard's primary (its sender token, when the shard checks
senders) at its own epoch or a newer one. A primary whose node lease lapsed (`lease_until`)
is fenced: it stops acknowledging, so an isolated primary cannot acknowledge beside the backup
the coordinator promotes once the node's lease has expired there too.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch
import zmq

from gossamer.core.errors import AuthError, ProtocolError
from gossamer.core.protocol import (
    Authority,
    ReplicateMeta,
    SyncMeta,
    chunk_key,
    parse_chunk_key,
)
from gossamer.paramserver._push_decoding import EncodedPart, PushDecoders
from gossamer.paramserver._reject import Reject
from gossamer.paramserver._state import ShardState
from gossamer.security import sender_tokens
from gossamer.security.curve import CurveKeyring, HandshakeMonitor
from gossamer.transport.frames import (
    ZERO_COPY_THRESHOLD,
    FrameLimits,
    Message,
    decode,
    encode,
    frames_nbytes,
)
from gossamer.transport.outgoing import track
from gossamer.transport.router import (
    NOT_BACKUP,
    OUT_OF_ORDER,
    STALE_EPOCH,
    UNAUTHENTICATED,
    configure_socket,
    queue_depth,
)

__all__ = ["REPLICATE_WINDOW_BYTES", "SYNC_PART_BYTES", "Replication", "sync_parts"]

logger = logging.getLogger(__name__)

#: Bytes of REPLICATEs on their way to the backup and not acknowledged yet, past which the next one waits for an
#: ACK (the first always goes): a 1M-parameter shard's dense updates pipeline 16 deep, a 100M one's go one at a time.
REPLICATE_WINDOW_BYTES = 64 << 20
#: A SYNC goes as messages of at most about this many bytes of state (a group of whole chunks each),
#: all at once: the backup loads each into place and drops it as it comes, so it holds its state and the
#: few parts ZMQ has read ahead (its receive queue's depth), not its old state beside a whole new one.
SYNC_PART_BYTES = 16 << 20
_RETRY_S = 1.0  # a backup that refused the CURVE handshake is dialled again this often
_RESYNC_FIRST_S, _RESYNC_MAX_S = 1.0, 30.0  # backoff of re-attaching a detached backup


class Replication:
    """This replica's role (primary or backup) and, on a primary, the link to its backup.

    The serve loop polls `socket` (the DEALER to the backup, None without one) and calls
    `on_replies` and `check`; replies to workers go through `after_backup`.
    """

    def __init__(self, state: ShardState, limits: FrameLimits, curve: CurveKeyring | None, lock: threading.RLock,
                 decoders: PushDecoders, *, backup: bool, epoch: int = 0) -> None:
        self.state = state
        self.decoders = decoders  # the primary's decoders of pushes: a backup decodes forwarded ones with them
        self.config = state.config
        self.limits = limits
        self.curve = curve
        self._lock = lock
        self.context: zmq.Context | None = None  # the serve loop's, set when it binds
        self.is_primary = not backup
        self.epoch = epoch
        #: The experiment's sender key ("": senders are not checked, e.g. a shard without a coordinator).
        self.sender_key = ""
        #: time.monotonic() past which this node's lease has lapsed (None: no lease is kept).
        self.lease_until: float | None = None
        self.fenced_replies = 0  # acknowledgements withheld because the lease had lapsed
        # Unreplicated acknowledgements withheld while fenced: sent if the lease is renewed,
        # dropped if it is revoked (the worker then re-sends to the promoted backup).
        self._withheld: list[Callable[[], None]] = []
        self._said_fenced = False
        self.refused_promotions = 0
        self.promotions = 0
        self.backup_endpoint = ""
        self.socket: zmq.Socket | None = None
        self._watch: HandshakeMonitor | None = None
        self._retry_at = 0.0
        self.acked = 0
        self._synced = False
        self.sync_parts_in = 0  # SYNC parts this backup loaded
        # A SYNC in parts being loaded on a backup: (its version, its number of parts, the parts loaded so far).
        self._sync_in: tuple[int, int, int] | None = None
        self._sync_chunks: set[str] = set()  # the chunks (keys) the SYNC being loaded has brought
        self._awaiting: deque[tuple[int, float, Callable[[], None]]] = deque()
        # REPLICATEs made and not sent yet (version, frames, forwarded encoded), and those sent but not acknowledged
        # (version, bytes): the next goes once the bytes on their way leave it room (`REPLICATE_WINDOW_BYTES`).
        self._outbox: deque[tuple[int, list[bytes | memoryview], bool]] = deque()
        # Sent, not acknowledged: (version, bytes, the tracker done once libzmq let go of the frames).
        self._in_flight: deque[tuple[int, int, zmq.MessageTracker | None]] = deque()
        self.window_bytes = REPLICATE_WINDOW_BYTES
        self.window_waits = 0  # REPLICATEs that waited for the backup's ACK of those before them
        self.bytes_out = 0
        self.unreplicated = 0  # updates acknowledged to workers without a backup copy
        self.replicated_updates = 0
        self.replicated_encoded = 0  # of those, forwarded as the compressed pushes (the rest as a dense gradient)
        self.backup_detaches = 0
        self.resyncs = 0  # re-attachments of a detached backup (each with a full SYNC)
        self._resync_at: float | None = None  # when a detached backup is attached again
        self._resync_backoff = _RESYNC_FIRST_S
        self._name = f"shard {self.config.shard}"

    @property
    def replicated(self) -> bool:
        """True once a backup is attached and synced (acknowledged updates are on two replicas)."""
        return self.socket is not None and self._synced

    @property
    def fenced(self) -> bool:
        """The node's lease lapsed: this replica must not acknowledge (the coordinator may promote another)."""
        return self.lease_until is not None and time.monotonic() > self.lease_until

    def promote(self, reason: str, epoch: int | None = None) -> bool:
        """Become the primary at fencing `epoch` (None: the next one, for a shard run without a
        coordinator). A backup takes promotion only with a newer epoch than its own; returns
        whether this replica is now the primary at `epoch`."""
        epoch = self.epoch + 1 if epoch is None else epoch
        if self.is_primary:
            self.epoch = max(self.epoch, epoch)
            return True
        if epoch <= self.epoch:
            self.refused_promotions += 1
            logger.error("%s: promotion at epoch %d refused: this backup is at epoch %d (%s)", self._name, epoch,
                         self.epoch, reason)
            return False
        if self._sync_in is not None:
            # The coordinator promotes only a backup its primary said was synced; a SYNC under way means that
            # word was overtaken (the primary re-synced it just before it was lost). Said, not hidden.
            logger.error("%s: promoted with a SYNC to version %d loaded %d of %d parts: its chunks mix that "
                         "version's values with older ones", self._name, *self._sync_in[:1], self._sync_in[2],
                         self._sync_in[1])
            self._sync_in = None
        self.is_primary = True
        self.epoch = epoch
        self.promotions += 1
        logger.warning("%s: backup promoted to primary at version %d, epoch %d (%s)", self._name, self.state.version,
                       epoch, reason)
        return True

    # -- primary side -------------------------------------------------------------------
    def set_backup(self, endpoint: str) -> None:
        """Attach (or with "" detach) the backup at `endpoint`; it first gets a full SYNC."""
        if endpoint == self.backup_endpoint and (self.socket is not None or not endpoint):
            return
        self.close()
        if endpoint != self.backup_endpoint:  # another backup: it starts without a backoff
            self._resync_at, self._resync_backoff = None, _RESYNC_FIRST_S
        self.backup_endpoint = endpoint
        if not endpoint:
            self._flush(replicated=False)
            return
        assert self.context is not None
        b = self.context.socket(zmq.DEALER)
        # every part of a SYNC is queued at once (views of the live state: the depth costs no memory)
        configure_socket(b, self.limits, send_depth=queue_depth(self.limits) + self._max_sync_parts())
        if self.curve is not None:
            try:
                self.curve.secure_client(b, endpoint)
            except AuthError as e:
                b.close(linger=0)
                logger.error("%s: cannot attach backup %s: %s", self._name, endpoint, e)
                return
            self._watch = HandshakeMonitor(b)
        b.connect(endpoint)
        self.socket = b
        logger.info("%s: backup %s attached at version %d", self._name, endpoint, self.state.version)
        self._send_sync()

    def close(self) -> None:
        self._outbox.clear()
        self._in_flight.clear()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

    def _send_sync(self) -> None:
        self._synced = False
        self._flush(replicated=False)  # nothing waits on a SYNC: it is not timed as a stall
        self._outbox.clear()  # the SYNC carries what they would have; REPLICATEs after it go behind it
        self._in_flight.clear()
        # The live state, not a copy of it (2x the shard beside the state): a step while ZMQ still reads a part
        # writes its chunks aside (`ShardState.lend`). In parts of whole chunks (`SYNC_PART_BYTES`), so the backup
        # never holds a whole second state.
        meta, tensors = self.state.export(copy=False)
        parts = sync_parts(tensors, SYNC_PART_BYTES)
        for k, part in enumerate(parts):
            frames, tracker = track(self._frames("SYNC", {**meta.to_meta(), "part": k, "parts": len(parts)}, part))
            if not self._send(frames):
                return
            self.state.lend(tracker, part.values(), values=False)

    def _max_sync_parts(self) -> int:
        """The most parts a SYNC of this shard can take (values and up to two optimizer buffers per value)."""
        return 1 + 3 * 4 * sum(c.numel for c in self.state.chunks.values()) // SYNC_PART_BYTES + len(self.state.chunks)

    def _frames(self, op: str, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> list[bytes | memoryview]:
        """A message to the backup, signed as the shard's primary at this epoch."""
        sender = sender_tokens.primary_sender(self.config.shard)
        auth = sender_tokens.token_for(self.sender_key, sender) if self.sender_key else ""
        msg = Message(op=op, experiment=self.config.experiment, shard=self.config.shard, version=self.state.version,
                      sender=sender, meta={**meta, **Authority(auth=auth, epoch=self.epoch).to_meta()},
                      tensors=tensors)
        return encode(msg)

    def _send(self, frames: list[bytes | memoryview]) -> bool:
        """Send to the backup without blocking; a full queue detaches it (False)."""
        assert self.socket is not None
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.error("%s: the queue to backup %s is full (it does not keep up); detaching it", self._name,
                         self.backup_endpoint)
            self._detach()
            return False
        self.bytes_out += frames_nbytes(frames)
        return True

    def replicate(self, grads: dict[int, torch.Tensor] | Callable[[], dict[int, torch.Tensor]], lr_factor: float,
                  applied: list[tuple[str, int]], *, delay: int = 0, encoded: list[EncodedPart] | None = None) -> None:
        """Forward the update just applied (a no-op without a backup).

        `encoded`: the compressed pushes `grads` was decoded and added up from, in order. They
        are forwarded instead of `grads` when their message is the smaller one and fits the
        frame limits; the backup decodes and adds them up as this primary did, so both apply
        the same bits. Otherwise the dense fp32 gradient goes (both forms are exact); `grads` a
        function: it is made then (a step taken a group at a time never held it whole).
        """
        if self.socket is None:
            return
        meta = ReplicateMeta(lr_factor=lr_factor, applied=tuple(applied), delay=delay)
        frames = self._encoded_frames(meta, encoded) if encoded and self.config.replicate_encoded else None
        as_encoded = frames is not None
        if frames is None:
            dense = grads() if callable(grads) else grads
            frames = self._frames("REPLICATE", meta.to_meta(), {chunk_key(i): g for i, g in dense.items()})
            del dense
        if len(self._outbox) >= queue_depth(self.limits):
            logger.error("%s: %d updates wait for backup %s (it does not keep up); detaching it", self._name,
                         len(self._outbox), self.backup_endpoint)
            self._detach()
            return
        self._outbox.append((self.state.version, frames, as_encoded))
        self._send_next()
        if self._outbox:
            self.window_waits += 1

    def _send_next(self) -> None:
        """Send the waiting REPLICATEs that fit the window beside those not acknowledged yet."""
        while self._outbox and self.socket is not None:
            version, frames, as_encoded = self._outbox[0]
            nbytes = frames_nbytes(frames)
            if self._in_flight and sum(n for _, n, _ in self._in_flight) + nbytes > self.window_bytes:
                return
            self._outbox.popleft()
            tracker: zmq.MessageTracker | None = None
            if nbytes >= ZERO_COPY_THRESHOLD:  # smaller ones pyzmq copies: tracking would force a zero-copy hand-off
                frames, tracker = track(frames)  # the payload (a worker's push) is held until libzmq lets go
            if not self._send(frames):
                return
            self._in_flight.append((version, nbytes, tracker))
            self.replicated_updates += 1
            self.replicated_encoded += int(as_encoded)

    def held_bytes(self) -> int:
        """Bytes of updates this primary still holds for its backup: waiting for the window, or sent and
        not yet let go of by libzmq (each frame a view of the push it forwards, or its dense gradient)."""
        waiting = sum(frames_nbytes(frames) for _, frames, _ in self._outbox)
        return waiting + sum(n for _, n, tracker in self._in_flight if tracker is not None and not tracker.done)

    def _encoded_frames(self, meta: ReplicateMeta, encoded: list[EncodedPart]) -> list[bytes | memoryview] | None:
        """The REPLICATE of `encoded` (tensors "p{k}/<push tensor name>"), or None where the dense one
        is no larger or it would pass the backup's frame limits (many workers' pushes of a sync step)."""
        dense = sum(4 * c.numel for c in self.state.chunks.values())
        if sum(p.nbytes for p in encoded) >= dense:
            return None
        tensors = {f"p{k}/{name}": t for k, part in enumerate(encoded) for name, t in part.tensors.items()}
        frames = self._frames("REPLICATE", replace(meta, parts=tuple(p.compression for p in encoded)).to_meta(),
                              tensors)
        if (frames_nbytes(frames) >= dense or len(frames) - 1 > self.limits.max_tensors
                or len(frames[0]) > self.limits.max_header_bytes):
            return None
        return frames

    def on_replies(self, b: zmq.Socket) -> None:
        """Read the backup's ACKs (and refusals) on `b`."""
        while self.socket is b:  # a refusal detaches the backup: its socket is closed, stop reading it
            try:
                frames = b.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = decode(frames, self.limits)
            except ProtocolError as e:
                logger.warning("%s: undecodable reply from the backup: %s", self._name, e)
                continue
            with self._lock:
                if reply.op == "ACK":
                    if not self._synced and reply.meta.get("synced"):
                        self._synced = True
                        self._resync_backoff = _RESYNC_FIRST_S
                        logger.info("%s: backup %s synced at version %d", self._name, self.backup_endpoint,
                                    reply.version)
                    self.acked = max(self.acked, reply.version)
                    while self._in_flight and self._in_flight[0][0] <= self.acked:
                        self._in_flight.popleft()
                    self._send_next()
                    self._flush(replicated=self._synced)
                elif reply.meta.get("code") == OUT_OF_ORDER:
                    logger.warning("%s: backup out of order (%s); re-syncing", self._name, reply.meta.get("error"))
                    self._send_sync()
                else:
                    logger.error("%s: backup refused replication: %s; detaching it", self._name,
                                 reply.meta.get("error"))
                    self._detach()

    def check(self, now: float) -> None:
        """Redial a backup that refused the handshake; detach one silent for `backup_timeout_s`;
        re-attach a detached one when its backoff is over; say when fenced."""
        fenced = self.fenced
        if fenced != self._said_fenced and self.is_primary:
            self._said_fenced = fenced
            if fenced:
                logger.error("%s: this node's lease lapsed (epoch %d): acknowledging nothing until it is renewed%s",
                             self._name, self.epoch, " (revoked for good)" if self.lease_until == 0.0 else "")
            else:
                logger.warning("%s: lease renewed (epoch %d): acknowledging again", self._name, self.epoch)
        if self._withheld and (not fenced or self.lease_until == 0.0):
            withheld, self._withheld = self._withheld, []
            for reply in withheld if not fenced else ():
                self.unreplicated += int(self.config.expect_backup)
                reply()
        if self.socket is None and self.backup_endpoint and self._resync_at is not None and now >= self._resync_at:
            self._resync_at = None
            self.resyncs += 1
            logger.warning("%s: re-attaching backup %s (attempt %d) with a full SYNC", self._name,
                           self.backup_endpoint, self.resyncs)
            self.set_backup(self.backup_endpoint)
            return
        watch = self._watch
        if watch is not None and watch.check() is not None and watch.fatal and now >= self._retry_at:
            # libzmq gave up on this connection (the backup does not know our key yet, or
            # not any more): try again on a new socket, with a full SYNC, once a second.
            logger.error("%s: backup %s refused the CURVE handshake: %s; retrying", self._name,
                         self.backup_endpoint, watch.failure)
            self._retry_at = now + _RETRY_S
            endpoint, self.backup_endpoint = self.backup_endpoint, ""
            self.close()
            self.set_backup(endpoint)
        if self._awaiting and now - self._awaiting[0][1] > self.config.backup_timeout_s and self.socket is not None:
            # What the backup sent while the serve thread was busy (a long step, a wait for the checkpoint's
            # writer) counts: it is silent only if nothing came.
            self.on_replies(self.socket)
        if self._awaiting and now - self._awaiting[0][1] > self.config.backup_timeout_s:
            logger.error("%s: backup %s silent for %.1fs; acknowledging unreplicated until a new backup is "
                         "attached", self._name, self.backup_endpoint, self.config.backup_timeout_s)
            self._detach()

    def _detach(self) -> None:
        """Stop replicating to the backup; it is attached again (a full SYNC) after the backoff."""
        self.close()
        self._synced = False
        self.backup_detaches += 1
        self._resync_at = time.monotonic() + self._resync_backoff
        self._resync_backoff = min(_RESYNC_MAX_S, 2 * self._resync_backoff)
        self._flush(replicated=False)

    @property
    def answers_at_once(self) -> bool:
        """Whether `after_backup` sends the answers to an update being applied now at once: no synced
        backup to wait for, and no lease lapsed."""
        return not (self.socket is not None and self._synced) and not self.fenced

    def after_backup(self, reply: Callable[[], None]) -> None:
        """Send `reply` now, or once the backup holds the current version (not while a SYNC is on its way)."""
        if self.socket is not None and self._synced and self.state.version > self.acked:
            self._awaiting.append((self.state.version, time.monotonic(), reply))
        elif self.fenced:
            self.fenced_replies += 1  # unreplicated and past the lease: held until it is renewed
            self._withheld.append(reply)
        else:
            if self.is_primary and self.socket is None and self.config.expect_backup:
                self.unreplicated += 1
            reply()

    def _flush(self, *, replicated: bool) -> None:
        while self._awaiting and (not replicated or self._awaiting[0][0] <= self.acked):
            _, _, reply = self._awaiting.popleft()
            if not replicated and self.fenced:
                self.fenced_replies += 1
                self._withheld.append(reply)
                continue
            if not replicated:
                self.unreplicated += 1
            reply()

    # -- backup side ----------------------------------------------------------------------
    def load(self, meta: SyncMeta, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the state (a SYNC, a restore): everything up to its version counts as acknowledged."""
        self.state.load(meta, tensors)
        self.acked = self.state.version

    def _from_primary(self, msg: Message) -> None:
        """Refuse replication that is not from the shard's primary at this epoch or a newer one."""
        if self.is_primary:
            raise Reject(f"{msg.op} sent to a primary (this replica was promoted)", NOT_BACKUP)
        try:
            authority = Authority.from_meta(msg.op, msg.meta)
        except ProtocolError as e:
            raise Reject(str(e)) from None
        primary = sender_tokens.primary_sender(self.config.shard)
        if self.sender_key and (msg.sender != primary
                                or not sender_tokens.verify(self.sender_key, primary, authority.auth)):
            raise Reject(f"{msg.op} from {msg.sender!r} refused: only the shard's primary replicates, with its "
                         "token", UNAUTHENTICATED, "unauthenticated")
        if authority.epoch < self.epoch:
            raise Reject(f"{msg.op} of epoch {authority.epoch} refused: this backup follows epoch {self.epoch}",
                         STALE_EPOCH, "stale_epoch")
        self.epoch = authority.epoch  # a newer primary, named by the coordinator before this backup heard

    def on_sync(self, msg: Message) -> bool:
        """One part of a full-state SYNC from the primary, loaded into place; True once the last part
        is (the backup then holds the primary's state at the SYNC's version).

        Parts come in order on the primary's connection; part 0 starts a SYNC (and abandons one not
        finished: the primary sent a new one), the others must continue the SYNC being loaded. Until
        the last, the state mixes chunks of the old and the new one; the primary counts the backup
        as replicated only once it acknowledged the last.
        """
        self._from_primary(msg)
        meta = SyncMeta.from_meta(msg.meta)
        part, parts = msg.meta.get("part", 0), msg.meta.get("parts", 1)
        if (not isinstance(part, int) or not isinstance(parts, int) or isinstance(part, bool)
                or isinstance(parts, bool) or not 0 <= part < parts or parts > self._max_sync_parts()):
            raise Reject(f"SYNC meta 'part' {part!r} of 'parts' {parts!r} is out of range")
        if part == 0:
            self._sync_in = (meta.state_version, parts, 0)
        if self._sync_in is None or self._sync_in[:2] != (meta.state_version, parts) or self._sync_in[2] != part:
            self._sync_in = None
            raise Reject(f"SYNC part {part} of {parts} at version {meta.state_version} continues no SYNC this "
                         "backup is loading", OUT_OF_ORDER)
        if part == 0:
            self._sync_chunks = set()
        try:
            if part == 0 and parts == 1:
                self.load(meta, msg.tensors)  # the whole state in one message
            else:
                if again := self._sync_chunks.intersection(chunk_key(i) for i in self.state.chunks
                                                           if chunk_key(i) in msg.tensors):
                    raise Reject(f"SYNC part {part} carries chunks an earlier part did: {sorted(again)[:4]}")
                self._sync_chunks.update(chunk_key(i) for i in self.state.load_chunks(meta, msg.tensors))
                msg.tensors.clear()
                if part + 1 == parts and len(self._sync_chunks) != len(self.state.chunks):
                    raise Reject(f"SYNC of {parts} parts carried {len(self._sync_chunks)} of this shard's "
                                 f"{len(self.state.chunks)} chunks")
        except Reject:
            self._sync_in = None  # this SYNC is broken off: the primary sends a new one
            raise
        self.sync_parts_in += 1
        if part + 1 < parts:
            self._sync_in = (meta.state_version, parts, part + 1)
            return False
        self._sync_in = None
        if parts > 1:
            self.state.finish_load(meta)
            self.acked = self.state.version
        logger.info("%s: backup synced at version %d (%d part%s)", self._name, self.state.version, parts,
                    "" if parts == 1 else "s")
        return True

    def on_replicate(self, msg: Message) -> None:
        """Replay one update the primary applied."""
        self._from_primary(msg)
        if msg.version != self.state.version + 1:
            raise Reject(f"REPLICATE of version {msg.version} but this backup is at {self.state.version}",
                         OUT_OF_ORDER)
        try:
            meta = ReplicateMeta.from_meta(msg.meta)
        except ProtocolError as e:
            raise Reject(str(e)) from None
        if meta.parts:  # checked whole, then decoded again a group of chunks at a time into the step
            parts = self.decoders.forwarded_parts(meta.parts, msg.tensors)
            grads: dict[int, torch.Tensor] | Callable[[list[int]], dict[int, torch.Tensor]] = functools.partial(
                self.decoders.summed, parts)
        else:
            grads = self._dense(msg.tensors)
        if meta.delay:
            self.state.set_delay(meta.delay)
        self.state.step(grads, meta.lr_factor, schedule=False)
        self.state.remember(meta.applied, latest=True)

    def _dense(self, tensors: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """A dense REPLICATE's gradient: one fp32 tensor per chunk of the shard."""
        grads: dict[int, torch.Tensor] = {}
        for name, t in tensors.items():
            idx = parse_chunk_key(name)
            c = self.state.chunks.get(idx)
            if c is None or t.dtype != torch.float32 or tuple(t.shape) != (c.numel,):
                raise Reject(f"REPLICATE tensor {name!r} does not fit this shard")
            grads[idx] = t
        if set(grads) != set(self.state.chunks):
            raise Reject("REPLICATE must carry every chunk of the shard")
        return grads


def sync_parts(tensors: dict[str, torch.Tensor], part_bytes: int) -> list[dict[str, torch.Tensor]]:
    """An exported state ("c3", "c3/momentum_buffer", ...) cut into groups of whole chunks, in chunk order,
    each of at most `part_bytes` unless one chunk alone is larger; at least one group."""
    by_chunk: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        by_chunk.setdefault(name.partition("/")[0], {})[name] = t
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(by_chunk, key=parse_chunk_key):
        group = by_chunk[key]
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if parts[-1] and size + nbytes > part_bytes:
            parts.append({})
            size = 0
        parts[-1].update(group)
        size += nbytes
    return parts
