"""A shard's serve loop: its ROUTER, the commands posted from other threads, and the dispatch of each op."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from gossamer.core.errors import ProtocolError
from gossamer.core.faults import fail_at, hold_at
from gossamer.core.protocol import (
    Authority,
    CreditMeta,
    HelloMeta,
    PullMeta,
    WelcomeMeta,
    clocks_of,
    parse_chunk_key,
)
from gossamer.paramserver._budget_waits import BudgetWaits, Waiting
from gossamer.paramserver._reject import Reject
from gossamer.paramserver._replication import Replication
from gossamer.paramserver._replies import Replies
from gossamer.paramserver._seeding import Seeding
from gossamer.paramserver._updates import Updates
from gossamer.paramserver.push_credits import CREDIT_MIN_BYTES, MAX_WAITING, PushCredits
from gossamer.security import sender_tokens
from gossamer.security.curve import CurveKeyring
from gossamer.transport.frames import FrameLimits, Message, decode, frames_nbytes
from gossamer.transport.ratelimit import RateLimit
from gossamer.transport.router import (
    BUDGETED_SEND_DEPTH,
    FAILED_PRECONDITION,
    FENCED,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_A_WORKER,
    NOT_FOUND,
    NOT_PRIMARY,
    RESOURCE_EXHAUSTED,
    SEEDING,
    UNAUTHENTICATED,
    UNIMPLEMENTED,
    Router,
)

__all__ = ["ServeLoop"]

logger = logging.getLogger(__name__)

_POLL_MS = 20
_DEFERRED_POLL_MS = 1
_EXPIRE_EVERY_S = 0.05
_RECV_BATCH = 256
#: Ops only the workers send: only a primary holding its lease serves them, and only to their own sender.
_WORKER_OPS = ("HELLO", "PULL", "PUSH", "LEAVE", "SEED", "CREDIT")
#: Ops that speak for their sender: with CURVE, only over the connection of that sender's node key.
_SENDER_OPS = (*_WORKER_OPS, "SYNC", "REPLICATE")
#: Requests refused because the connection, or the server, holds its most in unread replies.
OVER_BUDGET = "reply_budget"


class _AwaitBudget(Exception):
    """A current worker's request over its connection's reply budget: it waits (`BudgetWaits`), not refused."""


class ServeLoop:
    """Receives on the shard's ROUTER (and the backup's DEALER) and dispatches each op.

    Single-threaded; every request is handled under `lock`, which other threads take too.
    """

    def __init__(self, updates: Updates, replication: Replication, replies: Replies, *, limits: FrameLimits,
                 curve: CurveKeyring | None, rate_limit: RateLimit | None, lock: threading.RLock,
                 stats: Callable[[], dict[str, Any]]) -> None:
        self.updates = updates
        self.state = updates.state
        self.config = updates.config
        self.replication = replication
        self.replies = replies
        self.limits = limits
        self.curve = curve
        self.rate_limit = rate_limit
        self.lock = lock
        self._stats = stats
        # By the router's gate (unroutable, not_member, rate_limit), replies dropped (queue_full,
        # peer_gone) and requests over the reply budget (reply_budget).
        self.refused: Counter[str] = replies.dropped
        self.bytes_in = 0
        self._ctx: zmq.Context | None = None
        self.router: Router | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: Set while the shard is rebuilt from its workers' copies (see `_seeding`).
        self.seeding: Seeding | None = None
        #: Called under the lock on every expiry tick (e.g. to take a workers' copy once chosen).
        self.periodic: list[Callable[[float], None]] = []
        self._name = f"shard {self.config.shard}"
        #: Why the serve loop ended other than by its stop event (its thread died), else None.
        self.failure: BaseException | None = None
        self._serving = False  # the loop owns the sockets from its start until it returns
        # One dense push of this shard read at a time (a large compressed one may share it).
        shard_bytes = sum(4 * c.numel for c in self.state.chunks.values())
        self.credits = PushCredits(max(CREDIT_MIN_BYTES, shard_bytes))
        #: Pushes kept back while a checkpoint's writer is behind, in arrival order (identity, message, key).
        self._deferred: collections.deque[tuple[bytes, Message, str | None]] = collections.deque()
        self.deferred_pushes = 0
        self._deferred_bytes = 0
        #: Current workers' requests over their connection's reply budget, waiting for its replies' release.
        self.budget_waits = BudgetWaits(self.credits.budget_bytes, MAX_WAITING)

    @property
    def curve_refused(self) -> int:
        return self.router.curve_refused if self.router is not None else 0

    def bind(self, host: str, port: int) -> str:
        self._ctx = zmq.Context()
        # Its PARAMS replies are held back by the reply budget: the send queue holds small replies.
        self.router = Router(self._ctx, name=self._name, limits=self.limits, refusal_reply=self.replies.refusal,
                             curve=self.curve, rate_limit=self.rate_limit, refused=self.refused,
                             send_depth=BUDGETED_SEND_DEPTH, outgoing=self.replies.outgoing)
        endpoint = self.router.bind(host, port)
        self.replies.router = self.router
        self.replication.context = self._ctx
        return endpoint

    def close(self) -> None:
        """Close the sockets (unless a serve loop still owns them: it closes them as it returns)."""
        if self._serving:
            logger.error("%s: close() while the serve loop still runs; its sockets stay with it", self._name)
            return
        self.replication.close()
        if self.router is not None:
            self.router.close()
            self.router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the serve thread (under the lock) at the next loop iteration."""
        self._commands.put(fn)

    def _run_commands(self) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                try:
                    fn()
                except Exception:  # noqa: BLE001 — a bad command must not stop the shard
                    logger.exception("%s: command failed", self._name)

    def serve(self, stop: threading.Event) -> None:
        """The single-threaded poll loop; returns when `stop` is set.

        The thread running it owns the shard's sockets (the ROUTER, the DEALER to the backup)
        and closes them as it returns; an exception that ends it is kept in `failure`.
        """
        if self.router is None:
            raise RuntimeError("bind() before serve()")
        self._serving = True
        try:
            self._loop(stop, self.router.socket)
        except BaseException as e:
            self.failure = e
            logger.critical("%s: the serve loop died: %s: %s", self._name, type(e).__name__, e)
            raise
        finally:
            with self.lock:
                self.replication.close()
            if self.failure is not None:  # a test widens the window in which the role could misreport the link
                hold_at("serve-exit", shard=self.config.shard)
            self.router.close_socket()
            self._serving = False

    def _loop(self, stop: threading.Event, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        polled_backup: zmq.Socket | None = None
        next_expire = time.monotonic() + _EXPIRE_EVERY_S
        while not stop.is_set():
            self._run_commands()
            if polled_backup is not self.replication.socket:
                if polled_backup is not None and polled_backup in dict(poller.sockets):
                    poller.unregister(polled_backup)
                polled_backup = self.replication.socket
                if polled_backup is not None:
                    poller.register(polled_backup, zmq.POLLIN)
            # Pushes kept back go as soon as what held them is gone (a reply leaving takes a millisecond).
            ready = dict(poller.poll(_DEFERRED_POLL_MS if self._deferred or self.budget_waits else _POLL_MS))
            if polled_backup is not None and polled_backup in ready:
                self.replication.on_replies(polled_backup)
            if sock in ready:
                for _ in range(_RECV_BATCH):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
            if self._deferred:
                self._run_deferred()
            if self.budget_waits:
                self._run_budget_waits()
            if self.credits.waiting():  # an update's payload the backup was sent may be gone now
                with self.lock:
                    self._reserve()
                    self._grant(self.credits.regrant(time.monotonic()))
            now = time.monotonic()
            if now >= next_expire:
                next_expire = now + _EXPIRE_EVERY_S
                fail_at("serve-loop", step=self.state.version, shard=self.config.shard)
                with self.lock:
                    self.updates.expire(now)
                    self._reserve()
                    self._grant(self.credits.expire(now, self.updates.is_member))
                    self.replication.check(now)
                    for fn in self.periodic:
                        fn(now)

    # -- requests -------------------------------------------------------------------------
    def _on_frames(self, frames: Sequence[zmq.Frame]) -> None:
        assert self.router is not None
        routable = len(frames) >= 2 and len(frames[0].buffer) > 0
        if routable:
            self.bytes_in += frames_nbytes(frames[1:])
        admitted = self.router.admit(frames)
        if admitted is None:
            if not routable:
                logger.warning("%s: dropped a message without a routable identity", self._name)
            return
        identity, payload = admitted
        try:
            msg = decode(payload, self.limits)
            key = self.router.peer_key(payload)
        except ProtocolError as e:
            self.updates.discarded["nonfinite" if "finite" in str(e) else "rejected"] += 1
            self.replies.error(identity, None, str(e), INVALID_ARGUMENT)
            return
        except Exception as e:  # keep serving whatever one request did
            logger.exception("%s: internal error decoding a request", self._name)
            self.replies.error(identity, None, f"internal error: {type(e).__name__}: {e}", INTERNAL)
            return
        # The message's tensors now hold the frames they need; a frame no tensor holds any
        # more (a forwarded push decoded into the sum) is then freed at once, not after the op.
        for held in (frames, payload):
            if isinstance(held, list):
                held.clear()
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors.values())
        if identity in self.budget_waits and self.budget_waits.may_add(identity, nbytes):
            # Behind a request of its connection waiting for the reply budget: after it, in order (a push's fragments).
            self.budget_waits.add(identity, Waiting(msg, key, nbytes, time.monotonic()))
            return
        # A fragment that is only gathered has nothing to keep back for; asked on each, the hold's second would
        # run out before the push's last fragment came.
        if msg.op == "PUSH" and (self._deferred or (not self._only_gathered(msg) and self._holds_back())) and \
                self._may_defer(nbytes):
            # A checkpoint's writer is behind: applied now, the push would wait for it and so would every
            # request behind it. Kept back (its credit with it: no other large push comes meanwhile) while
            # pulls and the rest are served.
            self._deferred.append((identity, msg, key))
            self._deferred_bytes += nbytes
            self.deferred_pushes += 1
            return
        self._handle(identity, msg, key)

    def _only_gathered(self, msg: Message) -> bool:
        """An async push's fragment that says more follow: gathered, the update stepped at the push's last."""
        return msg.op == "PUSH" and msg.meta.get("more") is True and not self.config.barrier

    def _may_defer(self, nbytes: int) -> bool:
        """Kept-back pushes stay within one dense push of the shard (the credits' budget): past it, or a flood of
        small ones, a push is handled at once as before (written aside, or a bounded wait for the writer)."""
        if not self._deferred:
            return True
        return len(self._deferred) < MAX_WAITING and self._deferred_bytes + nbytes <= self.credits.budget_bytes

    def _holds_back(self) -> bool:
        with self.lock:
            return self.state.holds_back(time.monotonic())

    def _run_deferred(self) -> None:
        while self._deferred and not self._holds_back():
            identity, msg, key = self._deferred.popleft()
            self._deferred_bytes -= sum(t.numel() * t.element_size() for t in msg.tensors.values())
            self._handle(identity, msg, key)

    def _run_budget_waits(self) -> None:
        """Serve the waiting requests whose connection's replies were released; refuse those that waited their time."""
        now = time.monotonic()
        for identity in self.budget_waits.identities():
            while (waiting := self.budget_waits.head(identity)) is not None:
                with self.lock:
                    over = waiting.msg.op in ("PULL", "PUSH") and self.replies.over_budget(identity) is not None
                if over and not self.budget_waits.expired(waiting.since, now):
                    break
                self.budget_waits.pop(identity)
                self._handle(identity, waiting.msg, waiting.key, waiting=waiting)
                if self.budget_waits.head(identity) is waiting:  # over the budget again: it waits on
                    break

    def _handle(self, identity: bytes, msg: Message, key: str | None, *, waiting: Waiting | None = None) -> None:
        """Dispatch a request and answer its failure; `waiting`: it waited for the reply budget (`budget_waits`)."""
        rid, op = msg.meta.get("rid"), msg.op
        keeps_credit = False
        try:
            with self.lock:
                self._dispatch(identity, msg, key, waiting)
            # A fragment gathered keeps its connection's credit: the push is one dense push of the shard however
            # it travels. Refused, it gives it back (the rest is sent again).
            keeps_credit = self._only_gathered(msg)
        except _AwaitBudget:
            keeps_credit = True  # not read yet: its credit stays with it
            nbytes = sum(t.numel() * t.element_size() for t in msg.tensors.values())
            self.budget_waits.add(identity, waiting or Waiting(msg, key, nbytes, time.monotonic()),
                                  front=waiting is not None)
        except ProtocolError as e:
            if op == "PUSH":
                self.updates.discarded["nonfinite" if "finite" in str(e) else "rejected"] += 1
            self.replies.error(identity, rid, str(e), INVALID_ARGUMENT)
        except Reject as e:
            if op == "PUSH":
                self.updates.discarded["nonfinite" if "not finite" in str(e) else e.cause] += 1
            self.replies.error(identity, rid, str(e), e.code)
        except Exception as e:  # keep serving whatever one request did
            logger.exception("%s: internal error handling a request", self._name)
            self.replies.error(identity, rid, f"internal error: {type(e).__name__}: {e}", INTERNAL)
        finally:
            if op == "PUSH" and not keeps_credit:  # read and handled (held, applied, or refused): the next may come
                with self.lock:
                    self._reserve()
                    self._grant(self.credits.pushed(identity, time.monotonic()))

    def _dispatch(self, identity: bytes, msg: Message, key: str | None = None, waiting: Waiting | None = None) -> None:
        if msg.experiment != self.config.experiment:
            raise Reject(f"experiment {msg.experiment!r} does not match this shard's {self.config.experiment!r}",
                         FAILED_PRECONDITION)
        if msg.shard != self.config.shard:
            raise Reject(f"message for shard {msg.shard} reached shard {self.config.shard}")
        now = time.monotonic()
        rid = msg.meta.get("rid")
        if msg.op in _SENDER_OPS:
            assert self.router is not None
            if not self.router.speaks_for(key, msg.sender):
                raise Reject(f"{msg.op} from {msg.sender!r} refused: this connection's CURVE key is not the key of "
                             "that sender's node", UNAUTHENTICATED, "unauthenticated")
        if msg.op in _WORKER_OPS:
            self._admit_worker_op(msg)
            if msg.op in ("PULL", "PUSH") and (why := self.replies.over_budget(identity)) is not None:
                if self._may_wait_for_budget(identity, msg, waiting):
                    raise _AwaitBudget
                self.refused[OVER_BUDGET] += 1
                if waiting is not None:
                    self.budget_waits.refused_after_wait += 1
                raise Reject(why, RESOURCE_EXHAUSTED, cause=OVER_BUDGET)
            if self.seeding is not None and msg.op in ("PULL", "PUSH"):
                raise Reject(f"shard {self.config.shard} lost every replica and is rebuilt from its workers' "
                             "copies: send a SEED", SEEDING, "seeding")
        if msg.op == "SEED":
            self._on_seed(msg, now)
            self.replies.send(identity, "ACK", {"rid": rid})
            return
        if msg.op == "REPLICATE":
            self.replication.on_replicate(msg)
            self.replies.send(identity, "ACK", {"rid": rid})
        elif msg.op == "SYNC":
            if self.replication.on_sync(msg):  # the last part of the SYNC: the others are not answered
                self.replies.send(identity, "ACK", {"rid": rid, "synced": True})
        elif msg.op == "HELLO":
            self._on_hello(identity, msg, now)
        elif msg.op == "PULL":
            self._on_pull(identity, msg, now)
        elif msg.op == "PUSH":
            self.updates.on_push(identity, msg, now)
        elif msg.op == "CREDIT":
            self._on_credit(identity, msg, now)
        elif msg.op == "STATS":
            self.replies.send(identity, "STATS", {"rid": rid, **self._stats()})
        elif msg.op == "LEAVE":
            self.updates.leave(msg.sender, now)
            self.replies.send(identity, "BYE", {"rid": rid})
        else:
            raise Reject(f"unknown op {msg.op!r}", UNIMPLEMENTED)

    def _may_wait_for_budget(self, identity: bytes, msg: Message, waiting: Waiting | None) -> bool:
        """A current worker's request waits for its replies' release (see `_budget_waits`); a stranger's never."""
        if not self.updates.is_member(msg.sender):
            return False
        if waiting is not None:
            return not self.budget_waits.expired(waiting.since, time.monotonic())
        return self.budget_waits.may_add(identity, sum(t.numel() * t.element_size() for t in msg.tensors.values()))

    def _admit_worker_op(self, msg: Message) -> None:
        """Refuse a worker op from a sender that cannot prove its id, or to a backup or fenced primary."""
        rep = self.replication
        if rep.sender_key:
            try:
                token = Authority.from_meta(msg.op, msg.meta).auth
            except ProtocolError as e:
                raise Reject(str(e), UNAUTHENTICATED, "unauthenticated") from None
            if not msg.sender or not sender_tokens.verify(rep.sender_key, msg.sender, token):
                raise Reject(f"{msg.op} from {msg.sender!r} refused: its sender token does not prove that id",
                             UNAUTHENTICATED, "unauthenticated")
        if not rep.is_primary:
            # Only the coordinator promotes (with a newer epoch); a worker it directed here
            # before this backup heard of its promotion retries.
            raise Reject(f"shard {self.config.shard} replica at epoch {rep.epoch} is a backup", NOT_PRIMARY,
                         "not_primary")
        if rep.fenced:
            raise Reject(f"shard {self.config.shard}'s node lease lapsed (epoch {rep.epoch}): it acknowledges "
                         "nothing until the lease is renewed", FENCED, "fenced")

    def _on_credit(self, identity: bytes, msg: Message, now: float) -> None:
        if msg.tensors:
            raise Reject("CREDIT carries no tensors")
        meta = CreditMeta.from_meta(msg.meta)
        if not self.updates.is_member(msg.sender):
            raise Reject(f"CREDIT from {msg.sender!r} refused: not a current worker of experiment "
                         f"{self.config.experiment!r} at this shard", NOT_A_WORKER, cause="not_member")
        if meta.nbytes > self.limits.max_message_bytes:
            raise Reject(f"a push of {meta.nbytes} bytes is over this shard's message limit "
                         f"({self.limits.max_message_bytes} bytes)")
        try:
            self._reserve()
            self._grant(self.credits.ask(identity, msg.sender, msg.meta.get("rid"), meta.nbytes, now))
        except OverflowError as e:
            raise Reject(f"no credit for now: {e}", RESOURCE_EXHAUSTED, cause=OVER_BUDGET) from None

    def _reserve(self) -> None:
        """What is already read and held of pushes counts against the credits: the updates for the backup."""
        self.credits.reserved = self.replication.held_bytes()

    def _grant(self, grants: list[tuple[bytes, Any]]) -> None:
        for identity, rid in grants:
            self.replies.send(identity, "GRANT", {"rid": rid})

    def _on_seed(self, msg: Message, now: float) -> None:
        """A worker's copy of (some of) this shard's chunks, at the shard version it last pulled."""
        if self.seeding is None:
            return  # rebuilt already (or never needed): nothing to do
        version = msg.meta.get("seed_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise Reject("SEED meta 'seed_version' must be an int >= 0")
        try:
            self.seeding.offer(msg.sender, version, {parse_chunk_key(k): t for k, t in msg.tensors.items()}, now,
                               clocks_of(msg.meta, "SEED", "seed_applied"))
        except (ValueError, ProtocolError) as e:
            raise Reject(str(e)) from None

    def _on_hello(self, identity: bytes, msg: Message, now: float) -> None:
        meta = HelloMeta.from_meta(msg.meta)
        gate = self.updates.gate
        if meta.fresh and msg.sender:
            # A new process under this id: its clocks restart, so forget the old ones.
            self.state.applied.pop(msg.sender, None)
            gate.forget(msg.sender)
        gate.join(msg.sender or identity.hex(), now)
        welcome = WelcomeMeta(done=self.state.done, plan=self.state.plan.fingerprint())
        self.replies.send(identity, "WELCOME", {"rid": msg.meta.get("rid"), **welcome.to_meta()})

    def _on_pull(self, identity: bytes, msg: Message, now: float) -> None:
        if msg.tensors:
            raise Reject("PULL carries no tensors")
        meta = PullMeta.from_meta(msg.meta)
        member = self.updates.is_member(msg.sender)
        if member:
            self.updates.gate.touch(msg.sender, now)
        elif meta.pull_codec != "none":
            # A view costs a copy of the shard: never for a sender the coordinator did not name.
            raise Reject(f"pull_codec {meta.pull_codec!r}: sender {msg.sender!r} is not a current worker of "
                         f"experiment {self.config.experiment!r}; pull compression keeps a view for current "
                         "workers only", FAILED_PRECONDITION)
        chunks = sorted(self.state.chunks) if meta.chunks is None else list(meta.chunks)
        unknown = [i for i in chunks if i not in self.state.chunks]
        if unknown:
            raise Reject(f"chunks {unknown[:8]} are not on shard {self.config.shard}", NOT_FOUND)
        keep = self.updates.may_keep_view(msg.sender)
        self.replies.views.note_codec(identity, msg.sender, meta.pull_codec, keep_view=keep)
        if keep:
            self.replies.views.restart(msg.sender, chunks)
        self.replies.params(identity, msg.meta.get("rid"), chunks)
