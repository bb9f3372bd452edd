"""The data-plane servers' ROUTER socket (shards, gossip peers): socket options, CURVE, limits, admission, error codes."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

import zmq

from gossamer.security.curve import CurveKeyring, MembershipAuthenticator, peer_key
from gossamer.transport.frames import ZERO_COPY_THRESHOLD, FrameLimits, peek_header
from gossamer.transport.outgoing import OutgoingReplies, Reservation
from gossamer.transport.ratelimit import PeerRateLimiter, RateLimit

__all__ = [
    "ABORTED",
    "FAILED_PRECONDITION",
    "FENCED",
    "INTERNAL",
    "INVALID_ARGUMENT",
    "NOT_BACKUP",
    "NOT_FOUND",
    "NOT_A_WORKER",
    "NOT_MEMBER",
    "NOT_PRIMARY",
    "OUT_OF_ORDER",
    "OVER_RATE",
    "PERMISSION_DENIED",
    "RATE_LIMITED",
    "REFORM",
    "SEEDING",
    "STALE_EPOCH",
    "UNAUTHENTICATED",
    "UNIMPLEMENTED",
    "UNROUTABLE",
    "BUDGETED_SEND_DEPTH",
    "QUEUE_BYTES",
    "RESOURCE_EXHAUSTED",
    "RefusalReply",
    "Router",
    "configure_socket",
    "queue_depth",
    "send_reply",
]

logger = logging.getLogger(__name__)

# -- the codes of ERROR replies (their meta "code") -------------------------------------------
#: Malformed, inconsistent or over a limit; nothing of the request was applied.
INVALID_ARGUMENT = "INVALID_ARGUMENT"
#: A chunk that is not on this shard.
NOT_FOUND = "NOT_FOUND"
#: Well-formed but not applicable now (another experiment, another step, a rollback): pull and redo.
FAILED_PRECONDITION = "FAILED_PRECONDITION"
#: The sender's CURVE key is not a member of the experiment (any more).
PERMISSION_DENIED = "PERMISSION_DENIED"
#: The sender is over its message rate (`RateLimit`).
RATE_LIMITED = "RATE_LIMITED"
#: An op this server does not serve.
UNIMPLEMENTED = "UNIMPLEMENTED"
#: The server failed handling the request (a bug); it keeps serving.
INTERNAL = "INTERNAL"
#: Another part of the same update was refused, so none of it is applied.
ABORTED = "ABORTED"
#: The sync barrier re-formed over a new membership: redo the step.
REFORM = "REFORM"
#: The server holds its most for this peer (or for all peers) in replies not yet read: read them first.
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
#: Replication (SYNC, REPLICATE) sent to a primary.
NOT_BACKUP = "NOT_BACKUP"
#: REPLICATE of a version the backup is not at: the primary re-syncs it.
OUT_OF_ORDER = "OUT_OF_ORDER"
#: A worker op (HELLO, PULL, PUSH, LEAVE) sent to a backup: only the coordinator promotes one;
#: a worker directed here early retries until the promotion lands.
NOT_PRIMARY = "NOT_PRIMARY"
#: The primary's node lease lapsed: it acknowledges nothing; the worker retries (or follows the new primary).
FENCED = "FENCED"
#: SYNC/REPLICATE from a replica of an older fencing epoch (a deposed primary).
STALE_EPOCH = "STALE_EPOCH"
#: The request's sender token does not prove its sender id (another member speaking for it).
UNAUTHENTICATED = "UNAUTHENTICATED"
#: The shard is rebuilt from its workers' copies (no replica, no checkpoint): send a SEED, then ask again.
SEEDING = "SEEDING"
#: A PUSH from a sender that is not (yet, or any more) one of the coordinator's current workers at
#: this shard: nothing of it is kept. A new worker's shard may not have heard of it yet: it asks again.
NOT_A_WORKER = "NOT_A_WORKER"

#: Why the admission gate refused a message (keys of the `refused` counter).
UNROUTABLE, NOT_MEMBER, OVER_RATE = "unroutable", "not_member", "rate_limit"
#: Why a reply was dropped (keys of the same counter): the peer's queue was full, the peer was gone.
QUEUE_FULL, PEER_GONE = "queue_full", "peer_gone"

#: What one socket's queue to (or from) one peer may hold, in bytes: ZMQ bounds queues in
#: messages, so the depth is this over the largest message (`queue_depth`).
QUEUE_BYTES = 256 << 20

_LOG_EVERY_S = 5.0  # a flood of refused messages must not flood the log too

#: Answers a request refused before it was decoded: (identity, rid, code, message).
RefusalReply = Callable[[bytes, Any, str, str], None]


def queue_depth(limits: FrameLimits) -> int:
    """ZMQ's high-water mark (messages) of every data-plane queue: `QUEUE_BYTES` over the largest
    message, 4 to 64. A queue to one peer then holds at most max(QUEUE_BYTES, 4 x max_message_bytes)."""
    return max(4, min(64, QUEUE_BYTES // limits.max_message_bytes))


#: The send queue of a ROUTER whose large replies are held back by a reply budget (a shard's
#: `ReplyBudget`): what is left to queue are small replies, so ZMQ's default depth.
BUDGETED_SEND_DEPTH = 1000


def configure_socket(sock: zmq.Socket, limits: FrameLimits, *, send_depth: int | None = None) -> None:
    """The options every data-plane socket (ROUTER or DEALER) gets.

    Finite queues both ways (`queue_depth`): a peer that stops reading fills its queue and no
    more. A ROUTER is set ZMQ_ROUTER_MANDATORY, so a send to a full queue or a gone peer
    raises instead of dropping silently; every send goes through `send_reply` (non-blocking),
    which counts the drop. A DEALER's full queue raises `zmq.Again` on a non-blocking send.
    `send_depth`: the send queue's depth instead (`BUDGETED_SEND_DEPTH`).
    """
    sock.copy_threshold = ZERO_COPY_THRESHOLD  # pyzmq copies below this; see frames.py
    sock.setsockopt(zmq.LINGER, 0)
    depth = queue_depth(limits)
    sock.setsockopt(zmq.SNDHWM, depth if send_depth is None else send_depth)
    sock.setsockopt(zmq.RCVHWM, depth)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    if sock.type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)


def send_reply(sock: zmq.Socket, identity: bytes, frames: Sequence[Any], dropped: Counter[str]) -> bool:
    """Send `frames` to `identity` on a ROUTER without blocking; False (counted in `dropped` by
    `QUEUE_FULL` or `PEER_GONE`) when the peer's queue is full or the peer is gone."""
    try:
        sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
    except zmq.Again:
        dropped[QUEUE_FULL] += 1
        return False
    except zmq.ZMQError as e:
        if e.errno != zmq.EHOSTUNREACH:
            raise
        dropped[PEER_GONE] += 1
        return False
    return True


class Router:
    """A server's ROUTER socket and the gate every message passes before it is decoded.

    The gate drops a message without a routable identity, refuses one whose connection's
    CURVE key is no longer a member (PERMISSION_DENIED) and one over its peer's rate
    (RATE_LIMITED, answered at most once per `RateLimit.answer_every_s`); each is counted in
    `refused` by `UNROUTABLE`, `NOT_MEMBER` or `OVER_RATE`. With CURVE, `speaks_for` says
    whether a decoded message's sender is the connection's own. Large replies go through
    `send_tracked` and are held against the server's reply budget (`outgoing`), which a request
    for one checks first (`over_budget`). Not thread-safe: one loop owns it.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        name: str,
        limits: FrameLimits,
        refusal_reply: RefusalReply,
        curve: CurveKeyring | None = None,
        rate_limit: RateLimit | None = None,
        refused: Counter[str] | None = None,
        send_depth: int | None = None,
        outgoing: OutgoingReplies | None = None,
    ) -> None:
        """`name`: how logs call the server; `refusal_reply` answers a refused request;
        `curve`: serve with CurveZMQ, accepting only the keyring's members; `refused`: the
        counter to count refusals in (default: a new one); `send_depth`: see `configure_socket`
        (default `BUDGETED_SEND_DEPTH` with `outgoing`, as what is left to queue then is small);
        `outgoing`: the reply budget large replies are held against (None: not bounded)."""
        self.name = name
        self.outgoing = outgoing
        self.limits = limits
        self.curve = curve
        self.refused: Counter[str] = refused if refused is not None else Counter()
        self._reply = refusal_reply
        self._rate = PeerRateLimiter(rate_limit) if rate_limit is not None else None
        self._logged = 0.0
        self.socket = ctx.socket(zmq.ROUTER)
        self._auth: MembershipAuthenticator | None = None
        try:
            # A queue sized for the largest message would drop small answers to an honest peer
            # that reads them all, whenever ZMQ's I/O thread falls behind a burst on a busy host.
            if send_depth is None and outgoing is not None:
                send_depth = BUDGETED_SEND_DEPTH
            configure_socket(self.socket, limits, send_depth=send_depth)
            if curve is not None:
                self._auth = curve.authenticator(ctx)
                curve.secure_server(self.socket)
        except Exception:
            self.close()
            raise

    @property
    def curve_refused(self) -> int:
        """CURVE handshakes the ZAP handler refused (keys of non-members)."""
        return self._auth.refused if self._auth is not None else 0

    def bind(self, host: str, port: int = 0) -> str:
        """Bind to `host` (a random port if 0); returns ``tcp://host:port``."""
        if port == 0:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.socket.bind(f"tcp://{host}:{port}")
        return f"tcp://{host}:{port}"

    def admit(self, frames: Sequence[Any]) -> tuple[bytes, Sequence[Any]] | None:
        """The sender's identity and the message's frames, or None: refused (counted, answered)."""
        if len(frames) < 2 or len(frames[0].buffer) == 0:
            self.refused[UNROUTABLE] += 1
            return None
        identity = frames[0].bytes
        payload = frames[1:]
        if self.curve is not None and not self.curve.is_member(peer_key(payload[0])):
            self.refused[NOT_MEMBER] += 1
            self._refuse(identity, payload[0], PERMISSION_DENIED,
                         "this node's CURVE key is not a member of the experiment (any more)")
            return None
        if self._rate is not None and not self._rate.allow(identity, time.monotonic()):
            self.refused[OVER_RATE] += 1
            if self._rate.answer(identity, time.monotonic()):
                self._refuse(identity, payload[0], RATE_LIMITED,
                             f"rate limit: over {self._rate.limit.messages_per_s:g} messages/s from this peer")
            return None
        return identity, payload

    def peer_key(self, payload: Sequence[Any]) -> str | None:
        """The CURVE public key (z85) the admitted message's connection authenticated with (None: plaintext)."""
        return peer_key(payload[0]) if self.curve is not None else None

    def speaks_for(self, key: str | None, sender: str) -> bool:
        """Whether a message that came with CURVE key `key` (`peer_key`) may name `sender`: with
        CURVE only the key the coordinator bound to `sender`; without CURVE any (the servers check
        sender tokens instead)."""
        return self.curve is None or self.curve.speaks_for(key, sender)

    def over_budget(self, identity: bytes, live: Collection[int] = ()) -> str | None:
        """Why `identity` may not be given a large reply now (its cap or the server's bytes), or None."""
        return self.outgoing.refusal(identity, live) if self.outgoing is not None else None

    def reserve(self, identity: bytes, nbytes: int) -> Reservation | None:
        """Hold `nbytes` of the reply budget for a request of `identity` answered later (None: no budget)."""
        return self.outgoing.reserve(identity, nbytes) if self.outgoing is not None else None

    def release(self, reserved: Reservation | None) -> None:
        """Give back a reservation whose reply will not be sent."""
        if reserved is not None and self.outgoing is not None:
            self.outgoing.release(reserved)

    def send_tracked(self, identity: bytes, frames: Sequence[Any], tracker: zmq.MessageTracker | None, nbytes: int,
                     *, shared: int | None = None, reserved: Reservation | None = None, counted: bool = True) -> bool:
        """Send a reply whose tensor frames are tracked (`outgoing.track`): it is held against the
        reply budget until ZMQ lets go of them. `shared`: the storage of values it references
        (counted once); `reserved`: the request's reservation, now this reply; `counted` False: not
        one of the replies held for `identity` (its bytes still count). False: dropped."""
        sent = send_reply(self.socket, identity, frames, self.refused)
        if self.outgoing is not None:
            if sent and tracker is not None:
                self.outgoing.add(identity, [tracker], nbytes, shared, reserved=reserved, counted=counted)
            elif reserved is not None:
                self.outgoing.release(reserved)
        return sent

    def _refuse(self, identity: bytes, head: Any, code: str, message: str) -> None:
        """Answer a request refused before decoding, with its rid so the client can match it."""
        now = time.monotonic()
        if now - self._logged > _LOG_EVERY_S:
            self._logged = now
            logger.warning("%s: refused a request: %s (%s)", self.name, message, code)
        header = peek_header(head, self.limits)
        meta = header.get("meta") if header is not None else None
        rid = meta.get("rid") if isinstance(meta, dict) else None
        if not isinstance(rid, int | str | None) or isinstance(rid, bool):
            rid = None
        self._reply(identity, rid, code, message)

    def close_socket(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)

    def stop_auth(self) -> None:
        """Stop the CURVE authenticator (after the socket's loop has stopped)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def close(self) -> None:
        """Close the socket and stop the CURVE authenticator (idempotent)."""
        self.close_socket()
        self.stop_auth()
