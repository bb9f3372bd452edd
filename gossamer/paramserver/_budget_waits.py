"""A current worker's requests that found its connection over the reply budget: kept in order until its replies are released.

The budget counts a reply as held until libzmq lets go of its frames, and pyzmq says so from
its garbage-collector thread: on a busy host that lags the peer's read by milliseconds. A
worker that read its replies and asks again (a fast step on loopback) then looked like a peer
that never reads, and its PUSH was refused (`reply_budget`). Its request waits here instead,
for at most `BUDGET_WAIT_S`: a worker that reads is served as soon as the lag is over; a peer
that does not read is refused at the end of the wait, as before. Strangers (senders the
coordinator did not name) never wait; what waits is bounded in bytes and in count.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from gossamer.transport.frames import Message

__all__ = ["BUDGET_WAIT_S", "BudgetWaits", "Waiting"]

#: How long a request waits for its connection's replies to be released before it is refused.
#: The release lags a worker's read by milliseconds (up to ~3 ms seen on 2 busy cores); a second
#: keeps a worker whose host stalls served and still refuses a peer that never reads.
BUDGET_WAIT_S = 1.0


@dataclass
class Waiting:
    """One request kept back: the message, its connection's CURVE key, its tensor bytes, since when it waits."""

    msg: Message
    key: str | None
    nbytes: int
    since: float


class BudgetWaits:
    """The waiting requests per connection (ZMQ identity), in arrival order. Not thread-safe: the serve loop owns it.

    At most `max_count` requests and `max_bytes` of their tensors wait in all (one request always
    may: a dense push larger than the bound still waits alone), a connection at most half of
    `max_bytes` once it has one waiting, so one peer never takes the room of the others.
    """

    def __init__(self, max_bytes: int, max_count: int, wait_s: float = BUDGET_WAIT_S) -> None:
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.wait_s = wait_s
        self._queues: dict[bytes, collections.deque[Waiting]] = {}
        self.waited = 0  # requests that waited (served or refused after)
        self.refused_after_wait = 0  # requests refused at the end of their wait

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._queues

    def _bytes(self, identity: bytes | None = None) -> int:
        queues = self._queues.values() if identity is None else [self._queues.get(identity, collections.deque())]
        return sum(w.nbytes for q in queues for w in q)

    def count(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def may_add(self, identity: bytes, nbytes: int) -> bool:
        """Whether a new request of `identity` carrying `nbytes` of tensors may wait."""
        if not self._queues:
            return True
        if self.count() >= self.max_count or self._bytes() + nbytes > self.max_bytes:
            return False
        return identity not in self._queues or self._bytes(identity) + nbytes <= self.max_bytes // 2

    def add(self, identity: bytes, waiting: Waiting, *, front: bool = False) -> None:
        """Keep `waiting` back: after the others of its connection, or (`front`: it waited already) before them."""
        queue = self._queues.setdefault(identity, collections.deque())
        if front:
            queue.appendleft(waiting)
        else:
            queue.append(waiting)
            self.waited += 1

    def identities(self) -> list[bytes]:
        return list(self._queues)

    def head(self, identity: bytes) -> Waiting | None:
        queue = self._queues.get(identity)
        return queue[0] if queue else None

    def pop(self, identity: bytes) -> Waiting:
        queue = self._queues[identity]
        waiting = queue.popleft()
        if not queue:
            del self._queues[identity]
        return waiting

    def expired(self, since: float, now: float) -> bool:
        """A request waiting since `since` has waited its time: it is refused if still over the budget."""
        return now - since >= self.wait_s
