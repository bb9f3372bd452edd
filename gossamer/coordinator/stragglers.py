"""Per-node step rates measured from workers' reports, judged by the straggler rule (`gossamer.core.straggler_rule`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from gossamer.coordinator.records import ExpRec
from gossamer.core.straggler_rule import STRAGGLER_FRACTION, stragglers
from gossamer.v1 import coordinator_pb2 as pb

#: Seconds of reports a rate is measured over.
WINDOW_S = 10.0
#: A rate needs at least this much history (two reports a second or more apart).
MIN_SPAN_S = 2.0

__all__ = ["MIN_SPAN_S", "STRAGGLER_FRACTION", "WINDOW_S", "StepRates", "stragglers", "worker_speeds"]


class StepRates:
    """Step counters of workers as the coordinator receives them, per (experiment, node).

    Times are the coordinator's own clock at receipt, so skewed node clocks do not matter;
    a worker that stops reporting sees its rate fall, because the rate runs up to now.
    """

    def __init__(self, window_s: float = WINDOW_S, min_span_s: float = MIN_SPAN_S) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._seen: dict[tuple[str, str], deque[tuple[float, float]]] = {}

    def observe(self, experiment_id: str, node_id: str, steps: float, now: float | None = None) -> None:
        """Record that `node_id`'s worker in `experiment_id` has done `steps` steps so far."""
        now = time.time() if now is None else now
        points = self._seen.setdefault((experiment_id, node_id), deque())
        if points and steps < points[-1][1]:
            points.clear()  # a new worker process: its counter starts over
        points.append((now, steps))
        # Keep one point older than the window: the base the rate is measured from.
        while len(points) > 2 and points[1][0] <= now - self.window_s:
            points.popleft()

    def observe_points(self, experiment_id: str, points: Iterable[Any], now: float | None = None) -> None:
        """Record the step counters in one ReportMetrics batch (rank 0 of each worker reports them)."""
        newest: dict[str, float] = {}
        for p in points:
            node_id, _, rank = p.source.partition("/")
            if rank == "0" and "updates" in p.values:
                newest[node_id] = max(newest.get(node_id, 0.0), float(p.values["updates"]))
        for node_id, steps in newest.items():
            self.observe(experiment_id, node_id, steps, now)

    def rate(self, experiment_id: str, node_id: str, now: float | None = None) -> float | None:
        """Steps per second over the window, up to `now`; None while there is too little history."""
        now = time.time() if now is None else now
        points = self._seen.get((experiment_id, node_id))
        if not points or len(points) < 2:
            return None
        base = points[0]
        for p in points:  # the newest point at or before the window start, else the oldest
            if p[0] <= now - self.window_s:
                base = p
        span = now - base[0]
        if points[-1][0] - base[0] < self.min_span_s or span <= 0:
            return None
        return (points[-1][1] - base[1]) / span

    def rates(self, experiment_id: str, node_ids: list[str], now: float | None = None) -> dict[str, float]:
        """{node_id: rate} for those of `node_ids` with a known rate."""
        out = {}
        for n in node_ids:
            r = self.rate(experiment_id, n, now)
            if r is not None:
                out[n] = r
        return out

    def forget(self, experiment_id: str) -> None:
        for key in [k for k in self._seen if k[0] == experiment_id]:
            del self._seen[key]


def worker_speeds(rates: StepRates, exp: ExpRec, now: float | None = None) -> tuple[dict[str, float], set[str]]:
    """({node_id: steps/s} of the experiment's current workers, the stragglers among them).

    Only a running experiment has stragglers: before it runs nobody steps, and after it
    ends the rates only decay.
    """
    if exp.state != pb.EXPERIMENT_STATE_RUNNING:
        return {}, set()
    known = rates.rates(exp.id, [r.node_id for r in exp.roles if r.role == pb.ROLE_WORKER], now)
    return known, stragglers(known)
