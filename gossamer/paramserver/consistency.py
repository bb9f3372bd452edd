"""Stale-synchronous-parallel bookkeeping of one shard: worker clocks, held replies, staleness.

SSP (Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous Parallel
Parameter Server") lets the fastest worker run at most `staleness` updates ahead of the
slowest active one: after applying worker w's update, w's reply (its next parameters) is
held back while ``clock[w] - min(active clocks) > staleness``. ``staleness=None`` is fully
asynchronous (nothing is ever held); ``staleness=0`` is lock-step.

A straggler does not hold the others back (unless `wait_for_stragglers`): a worker whose own pace
(the time between its updates, less the time its replies were held) is below half the median of
the workers' paces (`gossamer.core.straggler_rule`, the rule `gossamer status` flags by) is left out of the
slowest clock, like a suspect, and kept level with the slowest of the others. Its updates then
arrive staler and the staleness-aware lr takes them down. Backup workers in synchronous SGD drop
the slowest the same way (Chen et al. 2016, "Revisiting Distributed Synchronous SGD",
arXiv:1604.00981); held to the straggler, SSP runs the whole pool at its pace.

Staleness-aware learning rate (Zhang et al. 2016, "Staleness-aware Async-SGD for
Distributed Deep Learning", arXiv:1511.05950): an update computed on parameters
`version_staleness` versions old is applied with ``lr / max(1, version_staleness)``.

This module is pure logic (time is passed in), so it is unit-tested without sockets.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gossamer.core.errors import ConfigError
from gossamer.core.straggler_rule import PACE_SAMPLES, stragglers

__all__ = ["ApplyRecord", "SSPGate", "lr_factor"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: A straggler keeps pace again once its rate is at least this fraction of the median (it became one under
#: `STRAGGLER_FRACTION`).
KEEPS_PACE_FRACTION = 0.6


def lr_factor(version_staleness: float) -> float:
    """The staleness-aware lr multiplier 1/max(1, tau) of arXiv:1511.05950."""
    return 1.0 / max(1.0, version_staleness)


@dataclass(frozen=True)
class ApplyRecord:
    """What the gate recorded about one applied update."""

    lead: int
    version_staleness: int
    lr_factor: float


@dataclass
class _Worker:
    clock: int
    last_seen: float
    held: list[tuple[Any, float]] = field(default_factory=list)
    last_apply: float | None = None
    interval: float = 0.0  # moving average of the time between this worker's updates
    pace: float = 0.0  # ... of that time less what its replies were held: its own step time
    paces: int = 0  # how many gaps `pace` has seen
    held_s: float = 0.0  # seconds its replies were held since its last update


class SSPGate(Generic[T]):
    """Clock table of the active workers of one shard, and the replies held for SSP.

    A worker's clock counts its updates applied on this shard; a worker joining late starts
    level with the slowest active worker, so it neither stalls the others nor runs ahead.
    Workers that sent nothing for `worker_timeout_s` (and are not waiting on a held reply)
    drop out of the active set, which releases whoever waited on them.

    A worker silent for longer than ``max(suspect_floor_s, 3 x its usual update interval)``
    is *suspect*: it no longer holds the others back (a killed worker stalls the survivors
    for about one of its own steps, not until its lease expires). A worker with no update
    applied yet is judged by the slowest worker's interval. When a suspect speaks again it
    is re-floored to the slowest other worker's clock, like a late joiner.

    A worker whose own pace is below half the median (`gossamer.core.straggler_rule.stragglers` over the
    workers with `PACE_SAMPLES` gaps) is a *straggler*: left out of the slowest clock unless
    `wait_for_stragglers`, and re-floored to the slowest other clock whenever it speaks.
    """

    def __init__(
        self,
        staleness: int | None,
        *,
        lr_staleness_scaling: bool = False,
        staleness_in_rounds: bool = False,
        worker_timeout_s: float = 30.0,
        suspect_floor_s: float = 0.1,
        wait_for_stragglers: bool = False,
    ) -> None:
        if staleness is not None and (
            not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0
        ):
            raise ConfigError("staleness", f"must be an int >= 0 or None, got {staleness!r}")
        if worker_timeout_s <= 0:
            raise ConfigError("worker_timeout_s", f"must be > 0, got {worker_timeout_s!r}")
        self.staleness = staleness
        self.lr_staleness_scaling = lr_staleness_scaling
        # Each worker updates once per round (DiLoCo's outer step), so an update that saw
        # every other worker's last one is fresh: staleness counts rounds, versions / workers.
        self.staleness_in_rounds = staleness_in_rounds
        self.worker_timeout_s = worker_timeout_s
        self.suspect_floor_s = suspect_floor_s
        self.wait_for_stragglers = wait_for_stragglers
        self._stragglers: set[str] = set()
        self.straggler_updates = 0  # updates applied from a worker the bound did not wait for
        self._workers: dict[str, _Worker] = {}
        self._departed: dict[str, int] = {}
        self.lead_histogram: Counter[int] = Counter()
        self.version_staleness_histogram: Counter[int] = Counter()
        self.waits: Counter[str] = Counter()
        self.wait_seconds: dict[str, float] = {}

    # -- membership -------------------------------------------------------------------
    @property
    def active(self) -> list[str]:
        return sorted(self._workers)

    def min_clock(self, now: float | None = None, *, exclude: str = "") -> int | None:
        """Slowest clock among active workers (without suspects and stragglers when `now` is given)."""
        usual = self._usual_interval()
        return min(
            (
                w.clock
                for name, w in self._workers.items()
                if name != exclude and (now is None or not (self._suspect(w, now, usual) or self._exempt(name)))
            ),
            default=None,
        )

    def _exempt(self, name: str) -> bool:
        return name in self._stragglers and not self.wait_for_stragglers

    @property
    def stragglers(self) -> list[str]:
        """The workers judged stragglers now (waited for only with `wait_for_stragglers`)."""
        return sorted(self._stragglers)

    def _judge_paces(self, now: float) -> None:
        paces = {n: 1.0 / w.pace for n, w in self._workers.items() if w.paces >= PACE_SAMPLES and w.pace > 0}
        # One stays a straggler until clearly back (a pace near the cut would flip it every update).
        slow = stragglers(paces) | (self._stragglers & stragglers(paces, KEEPS_PACE_FRACTION))
        for name in slow - self._stragglers:
            logger.info("worker %s steps at %.3fs, under half the others' median pace: %s", name,
                        self._workers[name].pace,
                        "still waited for" if self.wait_for_stragglers else "the bound no longer waits for it")
        back, self._stragglers = self._stragglers - slow, slow
        for name in back:
            logger.info("worker %s keeps pace again", name)
            if not self.wait_for_stragglers:
                # Let back in between two of its own updates (the median moved), it is behind by what the
                # others did since its last: level with the slowest of them, as when it last spoke.
                self._level(name, now)

    def _usual_interval(self) -> float:
        """The slowest known update interval: what a worker with no history of its own is
        judged by."""
        return max((w.interval for w in self._workers.values()), default=0.0)

    def _suspect(self, w: _Worker, now: float, usual: float | None = None) -> bool:
        """`usual`: `_usual_interval()`, when the caller asks about every worker."""
        if w.held:
            return False
        if w.last_apply is None:
            # No update of its own applied yet (just joined, or killed between its HELLO and
            # its first push): judged by the others' pace, since exempting it held survivors
            # until its lease expired. If it is only slow, its first push re-floors it like a
            # late joiner. At the very start nobody has a pace yet, and nobody is suspected.
            interval = self._usual_interval() if usual is None else usual
            if interval == 0.0:
                return False
        else:
            interval = w.interval
        return now - w.last_seen > max(self.suspect_floor_s, 3.0 * interval)

    def suspects(self, now: float) -> list[str]:
        usual = self._usual_interval()
        return sorted(n for n, w in self._workers.items() if self._suspect(w, now, usual))

    def clock(self, worker: str) -> int | None:
        w = self._workers.get(worker)
        return None if w is None else w.clock

    def join(self, worker: str, now: float) -> None:
        """Register `worker` as active (idempotent; also refreshes its last-seen time)."""
        w = self._workers.get(worker)
        if w is not None:
            w.last_seen = now
            return
        floor = self.min_clock() or 0
        clock = max(self._departed.pop(worker, 0), floor)
        self._workers[worker] = _Worker(clock=clock, last_seen=now)
        # Back after timing out of the active set: level with the slowest clock the bound counts, not with a
        # straggler's or a suspect's (below it, the others' next updates would count leads past the bound).
        self._level(worker, now)
        logger.debug("worker %s joined at clock %d", worker, self._workers[worker].clock)

    def touch(self, worker: str, now: float) -> None:
        w = self._workers.get(worker)
        if w is None:
            self.join(worker, now)
            return
        if self._suspect(w, now) or self._exempt(worker):
            self._level(worker, now)
        w.last_seen = now

    def _level(self, worker: str, now: float) -> None:
        """Raise `worker`'s clock to the slowest of the others the bound counts (a suspect back, a straggler
        speaking or let back in): it then neither holds them back nor runs ahead."""
        w = self._workers[worker]
        floor = self.min_clock(now, exclude=worker)
        if floor is None:  # everyone else is quiet too: level with the slowest of them, stragglers aside
            floor = min((o.clock for n, o in self._workers.items() if n != worker and not self._exempt(n)),
                        default=self.min_clock(exclude=worker))
        if floor is not None and floor > w.clock:
            logger.debug("worker %s levelled after %.2fs; clock %d -> %d", worker, now - w.last_seen,
                         w.clock, floor)
            w.clock = floor

    def leave(self, worker: str, now: float) -> list[tuple[str, T]]:
        """Remove `worker`; returns its own held replies and any replies this releases."""
        w = self._workers.pop(worker, None)
        if w is None:
            return []
        self._departed[worker] = w.clock
        self._stragglers.discard(worker)
        out = [(worker, item) for item, _ in w.held]
        if w.held:
            self._count_wait(worker, now - min(since for _, since in w.held))
        return out + self.release(now)

    def expire(self, now: float) -> tuple[list[str], list[tuple[str, T]]]:
        """Drop workers silent for longer than the timeout; returns (dropped, released)."""
        dead = [
            name
            for name, w in self._workers.items()
            if not w.held and now - w.last_seen > self.worker_timeout_s
        ]
        released: list[tuple[str, T]] = []
        for name in dead:
            logger.info("worker %s timed out of the active set", name)
            released.extend(self.leave(name, now))
        return dead, released

    # -- updates ----------------------------------------------------------------------
    def on_apply(self, worker: str, *, version: int, basis: int, now: float) -> ApplyRecord:
        """Record an applied update of `worker` (computed on `basis`, applied at `version`).

        Returns the lead over the slowest active worker, the version staleness and the lr
        factor to use (1.0 unless `lr_staleness_scaling`). Advances the worker's clock.
        """
        self.touch(worker, now)
        w = self._workers[worker]
        if w.last_apply is not None:
            gap = now - w.last_apply
            w.interval = gap if w.interval == 0.0 else 0.8 * w.interval + 0.2 * gap
            own = max(0.0, gap - w.held_s)  # a worker held by the bound is not slow for it
            w.pace = own if w.paces == 0 else 0.8 * w.pace + 0.2 * own
            w.paces += 1
            self._judge_paces(now)
        w.last_apply = now
        w.held_s = 0.0
        if self._exempt(worker):
            self.straggler_updates += 1
        slowest = self.min_clock(now)
        lead = max(0, w.clock - (slowest if slowest is not None else w.clock))
        vs = max(0, version - basis)
        self.lead_histogram[lead] += 1
        self.version_staleness_histogram[vs] += 1
        w.clock += 1
        tau = vs / max(1, len(self._workers)) if self.staleness_in_rounds else vs
        factor = lr_factor(tau) if self.lr_staleness_scaling else 1.0
        return ApplyRecord(lead=lead, version_staleness=vs, lr_factor=factor)

    def must_wait(self, worker: str, now: float | None = None) -> bool:
        """True while `worker` is more than `staleness` clocks ahead of the slowest (non-suspect)."""
        if self.staleness is None:
            return False
        w = self._workers.get(worker)
        slowest = self.min_clock(now)
        if slowest is None and now is not None and self._exempt(worker):
            # A straggler with every other worker suspected: it does not run ahead of them while they stall
            # (once back, they would count its lead past the bound); a suspect gone for good expires.
            slowest = self.min_clock(exclude=worker)
        if w is None or slowest is None:
            return False
        return w.clock - slowest > self.staleness

    def hold(self, worker: str, item: T, now: float) -> None:
        """Keep `item` (a reply) until `must_wait(worker)` turns false."""
        self._workers[worker].held.append((item, now))

    def release(self, now: float) -> list[tuple[str, T]]:
        """Pop every held item whose worker may proceed now."""
        out: list[tuple[str, T]] = []
        for name, w in self._workers.items():
            if w.held and not self.must_wait(name, now):
                out.extend((name, item) for item, _ in w.held)
                # The parts of one multi-part update are one wait.
                self._count_wait(name, now - min(since for _, since in w.held))
                w.held = []
                w.last_seen = now
        return out

    def held_count(self) -> int:
        return sum(len(w.held) for w in self._workers.values())

    def _count_wait(self, worker: str, seconds: float) -> None:
        w = self._workers.get(worker)
        if w is not None:
            w.held_s += max(0.0, seconds)
        self.waits[worker] += 1
        self.wait_seconds[worker] = self.wait_seconds.get(worker, 0.0) + max(0.0, seconds)

    def stats(self) -> dict[str, Any]:
        """Histograms and wait counters (string keys, so they travel as msgpack maps)."""
        return {
            "staleness": {str(k): v for k, v in sorted(self.lead_histogram.items())},
            "version_staleness": {
                str(k): v for k, v in sorted(self.version_staleness_histogram.items())
            },
            "waits": dict(self.waits),
            "wait_seconds": {k: round(v, 6) for k, v in self.wait_seconds.items()},
            "clocks": {k: w.clock for k, w in sorted(self._workers.items())},
            "active": self.active,
            "stragglers": self.stragglers,
            "straggler_updates": self.straggler_updates,
        }

    def forget(self, worker: str) -> None:
        """Drop what is remembered of a departed `worker` (a new process under the same id)."""
        self._departed.pop(worker, None)
