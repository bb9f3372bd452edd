"""Per-peer message-rate limit of the data-plane servers: a token bucket per ROUTER identity, never blocking."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossamer.core.errors import ConfigError

__all__ = ["PeerRateLimiter", "RateLimit"]


@dataclass(frozen=True, kw_only=True)
class RateLimit:
    """At most `messages_per_s` messages per second from one peer, `burst` at once.

    The default is far above legitimate traffic: a worker sends one request per shard per
    step and waits for its reply, a primary one REPLICATE per applied update, a gossip
    neighbour one MASS (and perhaps a CANCEL) per step; on loopback a digits step takes
    over 1 ms, so no peer exceeds about 1,000 messages/s. A flood from one Python process
    runs at 50,000 and more.
    """

    messages_per_s: float = 10_000.0
    burst: int = 20_000
    #: A refused peer gets at most one ERROR reply per this interval; the rest are dropped
    #: (counted), so a flooder that never reads cannot make the server queue replies.
    answer_every_s: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.messages_per_s, int | float) and math.isfinite(self.messages_per_s)
                and self.messages_per_s > 0):
            raise ConfigError("messages_per_s", f"must be a finite number > 0, got {self.messages_per_s!r}")
        if not isinstance(self.burst, int) or isinstance(self.burst, bool) or self.burst < 1:
            raise ConfigError("burst", f"must be an int >= 1, got {self.burst!r}")
        if not self.answer_every_s >= 0:
            raise ConfigError("answer_every_s", f"must be >= 0, got {self.answer_every_s!r}")


class PeerRateLimiter:
    """Token buckets keyed by peer; a message over the rate is refused, never delayed.

    Not thread-safe: one server loop owns it. At most `max_peers` buckets are kept (the
    oldest is forgotten first; a forgotten peer starts again with a full burst).
    """

    def __init__(self, limit: RateLimit, *, max_peers: int = 4096) -> None:
        self.limit = limit
        self._rate = float(limit.messages_per_s)
        self._burst = float(limit.burst)
        self._max_peers = max_peers
        # peer -> [tokens, last refill, last answer]
        self._buckets: dict[bytes, list[float]] = {}
        self.refused = 0

    def allow(self, peer: bytes, now: float) -> bool:
        """Take one token of `peer`'s bucket; False (and counted) when it is empty."""
        b = self._buckets.get(peer)
        if b is None:
            if len(self._buckets) >= self._max_peers:
                del self._buckets[next(iter(self._buckets))]
            b = self._buckets[peer] = [self._burst, now, -math.inf]
        tokens = min(self._burst, b[0] + (now - b[1]) * self._rate)
        b[1] = now
        if tokens >= 1.0:
            b[0] = tokens - 1.0
            return True
        b[0] = tokens
        self.refused += 1
        return False

    def answer(self, peer: bytes, now: float) -> bool:
        """Whether a refused message of `peer` gets an ERROR reply (one per `answer_every_s`)."""
        b = self._buckets.get(peer)
        if b is None or now - b[2] >= self.limit.answer_every_s:
            if b is not None:
                b[2] = now
            return True
        return False
