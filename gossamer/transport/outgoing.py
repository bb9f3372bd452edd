"""What a server's large replies still hold in ZMQ's queues (or will, once answered): a cap per peer and a byte budget over all peers."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from gossamer.core.errors import ConfigError

__all__ = ["OutgoingReplies", "Reservation", "ReplyBudget", "track"]


def track(frames: Sequence[Any]) -> tuple[list[Any], zmq.MessageTracker]:
    """`frames` with every frame after the header (frame 0) a tracked `zmq.Frame`, and the
    tracker that is done once libzmq has let go of all of them."""
    tracked = [frames[0], *(zmq.Frame(f, track=True) for f in frames[1:])]
    return tracked, zmq.MessageTracker(*tracked[1:])


@dataclass(frozen=True, kw_only=True)
class ReplyBudget:
    """How much a server may hold in replies its peers have not read yet.

    A reply is held from its send until libzmq lets go of its frames (a `zmq.MessageTracker`):
    it has reached the kernel, or the peer's connection is gone. A peer (a ZMQ identity: one
    connection) has at most `per_peer` replies held; all peers together at most `max_bytes`
    of memory the server would not hold otherwise (`OutgoingReplies.held_bytes`). A request
    over either gets a small ERROR (`RESOURCE_EXHAUSTED`) and nothing of it is applied.
    """

    #: A worker waits for each reply before its next request on the same socket: 1 is all
    #: it needs; 2 leaves room for a reply still leaving while the next request arrives. A reply's
    #: release lags the peer's read on a busy host: a shard lets a current worker's request over
    #: this wait for it (`paramserver/_budget_waits`) instead of refusing it.
    per_peer: int = 2
    #: None: `ReplyBudget.default_bytes` of the server's largest reply.
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.per_peer, int) or isinstance(self.per_peer, bool) or self.per_peer < 1:
            raise ConfigError("per_peer", f"must be an int >= 1, got {self.per_peer!r}")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool)
                                           or self.max_bytes < 1):
            raise ConfigError("max_bytes", f"must be an int >= 1 or None, got {self.max_bytes!r}")

    @staticmethod
    def default_bytes(reply_bytes: int) -> int:
        """8 of the largest replies, at least 64 MiB."""
        return max(64 << 20, 8 * reply_bytes)


@dataclass(eq=False)
class Reservation:
    """A reply held against the budget: sent and tracked, or (`pending`) answered later."""

    identity: bytes
    trackers: list[Any]  # zmq.MessageTracker (anything with `.done`)
    nbytes: int
    shared: int | None  # the storage a reply of live values references (counted once), else None
    pending: bool = False  # reserved for a request not answered yet (`OutgoingReplies.reserve`)
    counted: bool = True  # one of the replies held for `identity` (`ReplyBudget.per_peer`)

    @property
    def done(self) -> bool:
        return not self.pending and all(t.done for t in self.trackers)


class OutgoingReplies:
    """The replies handed to ZMQ and not yet released, by peer. Not thread-safe: one loop owns it."""

    def __init__(self, budget: ReplyBudget, reply_bytes: int) -> None:
        self.budget = budget
        self.max_bytes = budget.max_bytes if budget.max_bytes is not None else ReplyBudget.default_bytes(reply_bytes)
        self._held: list[Reservation] = []
        self._per_peer: dict[bytes, int] = {}

    def _prune(self) -> None:
        if not any(h.done for h in self._held):
            return
        kept = []
        for h in self._held:
            if h.done and not h.counted:
                continue
            if h.done:
                n = self._per_peer[h.identity] - 1
                if n:
                    self._per_peer[h.identity] = n
                else:
                    del self._per_peer[h.identity]
            else:
                kept.append(h)
        self._held = kept

    def held_bytes(self, live: Collection[int] = ()) -> int:
        """Bytes held beyond what the server keeps anyway: each reply's own buffers, and each
        storage of values that replies reference, once, unless it is in `live` (the current values)."""
        self._prune()
        shared: dict[int, int] = {}
        for h in self._held:
            if h.shared is not None and h.shared not in live:
                shared[h.shared] = max(shared.get(h.shared, 0), h.nbytes)
        return sum(h.nbytes for h in self._held if h.shared is None) + sum(shared.values())

    def held_replies(self, identity: bytes | None = None) -> int:
        """Replies held for `identity` (None: for every peer)."""
        self._prune()
        return len(self._held) if identity is None else self._per_peer.get(identity, 0)

    def refusal(self, identity: bytes, live: Collection[int] = ()) -> str | None:
        """Why a request of `identity` may not be answered with a large reply now, or None."""
        if self.held_replies(identity) >= self.budget.per_peer:
            return (f"this connection has {self.budget.per_peer} replies it has not read yet "
                    "(ReplyBudget.per_peer): read them first")
        held = self.held_bytes(live)
        if held >= self.max_bytes:
            return (f"the server holds {held} bytes of replies not yet read, its budget is {self.max_bytes} "
                    "(ReplyBudget.max_bytes): retry later")
        return None

    def add(self, identity: bytes, trackers: list[Any], nbytes: int, shared: int | None,
            *, reserved: Reservation | None = None, counted: bool = True) -> None:
        """A reply just sent: held until every one of `trackers` is done. `reserved`: the
        reservation the request took (`reserve`), now this reply (released without trackers).
        `counted` False: its bytes are held, but it is not one of `identity`'s replies (`per_peer`)."""
        if reserved is not None:
            if not trackers:
                self.release(reserved)
                return
            reserved.trackers, reserved.nbytes, reserved.shared, reserved.pending = trackers, nbytes, shared, False
            return
        if not trackers:
            return
        self._held.append(Reservation(identity, trackers, nbytes, shared, counted=counted))
        if counted:
            self._per_peer[identity] = self._per_peer.get(identity, 0) + 1

    def reserve(self, identity: bytes, nbytes: int) -> Reservation:
        """Hold `nbytes` for a request of `identity` answered later (another thread builds the
        reply): it counts against both bounds until `add(..., reserved=)` or `release`."""
        held = Reservation(identity, [], nbytes, None, pending=True)
        self._held.append(held)
        self._per_peer[identity] = self._per_peer.get(identity, 0) + 1
        return held

    def release(self, reserved: Reservation) -> None:
        """Give back a reservation whose reply was not sent, or carried nothing to track."""
        if not reserved.pending:
            return
        reserved.pending = False
        self._prune()
