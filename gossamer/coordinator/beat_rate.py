"""Whether the coordinator keeps up with its nodes' heartbeats (served against due, and its own lag), so it never blames them when it does not."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gossamer.coordinator.records import NodeRec


@dataclass(kw_only=True)
class BeatRate:
    """Heartbeats served over the last `window_s` against `alive / interval_s` a second, and the reaper's lag.

    When the coordinator itself falls behind (CPU starved, a backlog of calls), every node's
    heartbeats arrive late together; a lease that expires then says more about the
    coordinator than about the node. Behind needs both signs: too few heartbeats served
    (silent nodes alone give that: a frozen machine) and the coordinator's own event loop
    late on its timers on average (a backlog or starvation alone gives that).
    """

    interval_s: float
    window_s: float
    #: Served below this share of the expected rate: too few.
    min_share: float = 0.8
    #: Mean lateness of the reaper's ticks over the window from which the loop counts as late.
    min_lag_share: float = 0.25
    served: int = 0
    _samples: deque[tuple[float, int, int, float]] = field(default_factory=deque)  # (time, served, alive, lag)

    def beat(self) -> None:
        self.served += 1

    def behind(self, now: float, alive: int, lag_s: float = 0.0) -> bool:
        """Whether, over the last window, fewer heartbeats were served than `min_share` of those due from
        `alive` nodes while the reaper's ticks were late (`lag_s`: this tick's lateness) by
        `min_lag_share` of an interval on average.

        `alive` counts the nodes whose connection is open: counting those heard from lately
        instead let a starved coordinator call itself caught up once enough nodes had fallen silent.
        """
        self._samples.append((now, self.served, alive, lag_s))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, served0, alive0, _ = self._samples[0]
        span = now - t0
        if span < self.interval_s * 2 or not alive:
            return False
        lag = sum(s[3] for s in self._samples) / len(self._samples)
        due = min(alive0, alive) * span / self.interval_s
        return self.served - served0 < self.min_share * due and lag >= self.min_lag_share * self.interval_s


def renew(node: NodeRec | None, rate: BeatRate) -> bool:
    """A heartbeat from `node` (None: unknown), over gRPC or UDP: its lease runs from now and `rate` counts it.

    False, renewing nothing, when the node is not known alive: it must Join again.
    """
    if node is None or not node.alive:
        return False
    node.last_seen = time.time()
    rate.beat()
    return True
