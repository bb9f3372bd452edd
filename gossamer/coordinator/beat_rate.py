"""Whether the coordinator keeps up with its nodes' heartbeats (served against expected), so it never blames them when it does not."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class BeatRate:
    """Heartbeats served over the last `window_s`, against `alive / interval_s` a second.

    When the coordinator itself falls behind (CPU starved, a backlog of calls), every node's
    heartbeats arrive late together; a lease that expires then says more about the
    coordinator than about the node. `behind` tells the reaper so (see `Coordinator.reap_leases`).
    """

    interval_s: float
    window_s: float
    #: Served below this share of the expected rate: behind.
    min_share: float = 0.8
    served: int = 0
    _samples: deque[tuple[float, int, int]] = field(default_factory=deque)  # (time, served, alive)

    def beat(self) -> None:
        self.served += 1

    def behind(self, now: float, alive: int) -> bool:
        """Whether, over the last window, fewer heartbeats were served than `min_share` of those due from `alive` nodes.

        `alive` counts the nodes whose connection is open: counting those heard from lately
        instead let a starved coordinator call itself caught up once enough nodes had fallen silent.
        """
        self._samples.append((now, self.served, alive))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, served0, alive0 = self._samples[0]
        span = now - t0
        if span < self.interval_s * 2 or not alive:
            return False
        due = min(alive0, alive) * span / self.interval_s
        return self.served - served0 < self.min_share * due
