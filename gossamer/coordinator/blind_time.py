"""Time the coordinator itself could not observe heartbeats (its lease sweeps ran late), kept out of nodes' silence."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class BlindTime:
    """How long, since a given moment, the coordinator was not scheduled to observe its nodes (pure, time passed in).

    The lease sweep runs every `tick_s`; a sweep that comes later than that says the process
    was not scheduled, or its event loop was held, for the excess. Heartbeats that reached the
    host meanwhile wait unread, so a node's silence over that time is the coordinator's own:
    a process that slept cannot judge others. `since(t)` is the blind time after `t`, which
    `failover.lease_verdict` takes out of a node's silence.

    Safety: this only ever makes a node's loss later than the plain lease. A node's shards
    fence themselves `shard_lease_s` after *sending* their last acknowledged heartbeat, with
    no regard for the coordinator, so a promotion that comes later still finds the isolated
    primary silent.
    """

    tick_s: float
    #: How far back `since` must answer (a lease and some): older sweeps are dropped.
    keep_s: float
    #: When watching began (the first sweep's gap is measured from it); None: from the first sweep.
    start: float | None = None
    #: Blind time in all (for the record).
    total: float = 0.0
    _sweeps: deque[tuple[float, float]] = field(default_factory=deque)  # (time, blind time of the gap it ends)

    def __post_init__(self) -> None:
        if self.start is not None:
            self._sweeps.append((self.start, 0.0))

    def sweep(self, now: float) -> float:
        """A lease sweep at `now`; the blind time it found (how much later than `tick_s` after the previous one)."""
        blind = max(0.0, now - self._sweeps[-1][0] - self.tick_s) if self._sweeps else 0.0
        self.total += blind
        self._sweeps.append((now, blind))
        while len(self._sweeps) > 2 and now - self._sweeps[1][0] > self.keep_s:
            self._sweeps.popleft()
        return blind

    def since(self, t: float) -> float:
        """Blind seconds between `t` and the last sweep.

        A moment inside a late gap (a heartbeat handled while the loop caught up) gets the
        part of that gap's blind time after it, in proportion; a moment before every sweep
        kept gets all of it.
        """
        # From the newest sweep back: a live node's last heartbeat falls in the last gap or two.
        after = 0.0  # blind time of the gaps wholly after `t`
        for i in range(len(self._sweeps) - 1, -1, -1):
            when, blind = self._sweeps[i]
            if t >= when:
                return after
            start = self._sweeps[i - 1][0] if i else when - blind - self.tick_s
            if t > start:
                return after + blind * (when - t) / (when - start)
            after += blind
        return after
