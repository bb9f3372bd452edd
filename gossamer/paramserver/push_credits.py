"""Push credits: a large push is sent only once its shard grants it, so a shard reads one dense push at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gossamer.core.protocol import CreditMeta
from gossamer.transport.frames import Message

__all__ = ["CREDIT_MIN_BYTES", "GRANT_TIMEOUT_S", "MAX_WAITING", "CreditAsker", "PushCredits"]

#: A push at least this large (its payload's bytes) asks its shard for a credit first (CREDIT, answered
#: GRANT) and is sent when granted. Without it ZMQ reads every worker's push as it arrives, whatever the
#: shard is doing, and an async primary held two dense pushes beside its state while it applied one. Below
#: it the extra round trip would cost more than the memory is worth.
CREDIT_MIN_BYTES = 16 << 20
#: A grant whose push has not arrived after this long is taken back (its worker died or was replaced on
#: the way); the push, if it still comes, is served all the same. Long enough for a 400 MB push at
#: 64 Mbit/s: taking a grant back too early only lets one more push be read at once.
GRANT_TIMEOUT_S = 60.0
#: Credit requests that may wait at once; more are refused (RESOURCE_EXHAUSTED) and asked again later.
MAX_WAITING = 1024


@dataclass
class _Ask:
    identity: bytes
    sender: str
    rid: Any
    nbytes: int
    at: float  # when asked, or when granted


class PushCredits:
    """Which connections may send a large push now: at most `budget_bytes` of granted pushes (and of
    `reserved` bytes) at once, and always one when nothing is held (a push larger than the budget goes
    alone). First come, first granted.

    Pure bookkeeping, time passed in; the serve loop sends the GRANTs it returns. A connection has
    at most one request: asking again (a resend, with a new request id) replaces its request or
    renews its grant.
    """

    def __init__(self, budget_bytes: int, *, grant_timeout_s: float = GRANT_TIMEOUT_S,
                 max_waiting: int = MAX_WAITING) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.grant_timeout_s = grant_timeout_s
        self.max_waiting = max_waiting
        self._waiting: dict[bytes, _Ask] = {}  # insertion order is the order of grants
        self._granted: dict[bytes, _Ask] = {}
        #: Requests that had to wait, grants taken back unused, requests refused with the queue full.
        self.waited = 0
        self.expired = 0
        self.refused = 0
        #: The most bytes granted at once.
        self.peak_granted_bytes = 0
        #: Bytes of pushes already read that the server still holds (set by its owner before each call):
        #: they count against the budget as grants do.
        self.reserved = 0

    @property
    def granted_bytes(self) -> int:
        return sum(a.nbytes for a in self._granted.values())

    @property
    def granted_count(self) -> int:
        return len(self._granted)

    def waiting(self) -> int:
        return len(self._waiting)

    def ask(self, identity: bytes, sender: str, rid: Any, nbytes: int, now: float) -> list[tuple[bytes, Any]]:
        """A credit request; returns the (identity, rid) pairs to send GRANT to now.

        Raises:
            OverflowError: `max_waiting` requests wait already (this one is not kept).
        """
        held = self._granted.get(identity)
        if held is not None:
            if len(self._granted) == 1 or self.granted_bytes - held.nbytes + nbytes <= self.budget_bytes:
                # A resend of a request already granted: grant it again under its new id.
                held.rid, held.nbytes, held.at = rid, nbytes, now
                return [(identity, rid), *self._grant(now)]
            del self._granted[identity]  # grown past what is left: it waits as a new request
        if identity not in self._waiting and len(self._waiting) >= self.max_waiting:
            self.refused += 1
            raise OverflowError(f"{len(self._waiting)} credit requests wait already")
        waiting = self._waiting.get(identity)
        if waiting is not None:  # a resend while waiting: keeps its place
            waiting.rid, waiting.nbytes = rid, nbytes
            return self._grant(now)
        self._waiting[identity] = _Ask(identity, sender, rid, nbytes, now)
        grants = self._grant(now)
        if identity in self._waiting:
            self.waited += 1
        return grants

    def pushed(self, identity: bytes, now: float) -> list[tuple[bytes, Any]]:
        """The push of `identity` was read and handled: its credit is free again."""
        if self._granted.pop(identity, None) is None:
            return []
        return self._grant(now)

    def expire(self, now: float, is_member: Callable[[str], bool]) -> list[tuple[bytes, Any]]:
        """Take back grants unused for `grant_timeout_s`, and drop what senders no longer members hold."""
        for table in (self._granted, self._waiting):
            for identity, ask in list(table.items()):
                stale = table is self._granted and now - ask.at > self.grant_timeout_s
                if stale or not is_member(ask.sender):
                    del table[identity]
                    self.expired += stale
        return self._grant(now)

    def regrant(self, now: float) -> list[tuple[bytes, Any]]:
        """Grant what fits now (after `reserved` went down)."""
        return self._grant(now)

    def _grant(self, now: float) -> list[tuple[bytes, Any]]:
        grants: list[tuple[bytes, Any]] = []
        granted = self.granted_bytes
        while self._waiting:
            identity, ask = next(iter(self._waiting.items()))
            if (self._granted or self.reserved > 0) and granted + self.reserved + ask.nbytes > self.budget_bytes:
                break
            del self._waiting[identity]
            ask.at = now
            self._granted[identity] = ask
            granted += ask.nbytes
            grants.append((identity, ask.rid))
        self.peak_granted_bytes = max(self.peak_granted_bytes, granted)
        return grants

    def stats(self) -> dict[str, int]:
        return {"credit_waited": self.waited, "credit_expired": self.expired, "credit_refused": self.refused,
                "credit_waiting": len(self._waiting), "credit_peak_bytes": self.peak_granted_bytes}



class CreditAsker:
    """A worker's side of the credits: which of its requests to a shard go as a CREDIT first.

    A push of at least `min_bytes` is sent as a CREDIT under the push's own rid; once that rid is
    granted (`granted`), the next send of the push sends the push and uses the grant up. A resend
    (a failover, a busy shard) asks again, as the shard let go of the grant when it read the push.
    """

    def __init__(self, min_bytes: int = CREDIT_MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._granted: dict[int, Any] = {}  # shard -> the rid it granted
        self._asking: set[int] = set()
        #: Credit requests sent.
        self.asked = 0

    def to_send(self, shard: int, msg: Message) -> Message:
        """What to send for `msg` now: `msg` itself, or the CREDIT that asks for it."""
        if msg.op != "PUSH":
            return msg
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors.values())
        self._asking.discard(shard)
        if nbytes < self.min_bytes or self._granted.pop(shard, None) == msg.meta.get("rid"):
            return msg
        self.asked += 1
        self._asking.add(shard)
        keep: dict[str, Any] = {k: msg.meta[k] for k in ("rid", "auth") if k in msg.meta}
        return Message(op="CREDIT", experiment=msg.experiment, shard=msg.shard, sender=msg.sender,
                       meta={**CreditMeta(nbytes=nbytes).to_meta(), **keep})

    def granted(self, shard: int, rid: Any) -> None:
        self._granted[shard] = rid
        self._asking.discard(shard)

    def asking(self, shard: int) -> bool:
        """Whether the last request sent to `shard` was a CREDIT not granted yet."""
        return shard in self._asking
