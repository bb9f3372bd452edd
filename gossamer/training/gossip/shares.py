"""Waiting for the in-neighbours' push-sum shares: of the last round (decentralized DiLoCo), or within a bounded lag (gossip)."""

from __future__ import annotations

import time
from collections.abc import Callable

from gossamer.training.gossip.pushsum import PushSumPeer
from gossamer.training.gossip.topology import out_peer, revisit_rounds

__all__ = ["LagBound", "ShareWait", "senders_to"]


def senders_to(topology: str, me: str, members: list[str], round: int, seed: int = 0) -> set[str]:
    """The members (ids that sort as ints, `me` among them or not) that push to `me` at `round`."""
    ranks = sorted({me, *members}, key=int)
    mine = ranks.index(me)
    return {r for i, r in enumerate(ranks) if r != me and out_peer(topology, i, len(ranks), round, seed) == mine}


class ShareWait:
    """Before a step mixes, wait (bounded) for the shares its in-neighbours sent at the end of their last step.

    Without it a share arrives while the receiver is finishing its own step and is mixed a step
    later: the half of the mass in flight misses that step's update, and every node is pulled back
    towards it, so the average moves about half as far per step. Digits, 3 workers, 400 steps, an
    in-process model over 12 seeds: 0.972 mixed at once, 0.965 a step late (sync mode: 0.970;
    bench/results/modes.md). A neighbour whose share did not come in time is not waited for
    again until one of its shares does (a dead peer not yet removed costs one wait, not one per step).
    """

    def __init__(self, limit_s: float = 1.0) -> None:
        self.limit_s = limit_s
        self.late = 0  # steps that began before an expected share was in
        self.timeouts = 0  # ... and that went on without it
        self._silent: set[str] = set()

    def wait(self, peer: PushSumPeer, expected: set[str], step: int, *, serve: Callable[[], None],
             should_stop: Callable[[], bool], limit_s: float | None = None) -> set[str]:
        """Wait until every sender in `expected` has a share of `step` (or later) in; returns the missing ones.
        `limit_s`: this wait's bound instead of `self.limit_s`."""
        arrived = peer.arrived_from(step)
        self._silent -= arrived
        missing = expected - arrived - self._silent
        if not missing:
            return set()
        self.late += 1
        deadline = time.monotonic() + (self.limit_s if limit_s is None else limit_s)
        while missing and time.monotonic() < deadline and not should_stop():
            serve()
            missing -= peer.arrived_from(step, timeout=0.02)
        if missing:
            self.timeouts += 1
            self._silent |= missing
        return missing


class LagBound:
    """Bounded delay between gossip neighbours: a node does not begin step t while an in-neighbour
    it has heard from is more than `lag` steps behind it (in the step of that neighbour's latest
    share that came in, allowing the rounds the graph takes to visit again).

    SGP's analysis of its overlap variant assumes messages delayed by at most tau steps (Assran et al.
    2019, https://arxiv.org/abs/1811.10792, tau = 1 in its experiments), AD-PSGD's a bounded
    staleness (Lian et al. 2018, https://arxiv.org/abs/1710.06952). Unbounded, a node that runs
    faster finishes first and refuses mass while the slower ones take their last steps alone, and
    those steps are not averaged before the end: digits, 3 workers, 400 steps, the final consensus
    distance was 0.03 to 0.3 where it was 1e-3 to 2e-3 at step 300; bounded, 2e-3, and the mean
    accuracy over 6 seeds 0.975 against 0.965 (sync 0.971; bench/results/modes.md). Unlike `ShareWait` this waits
    for no particular share: a fast node holds until the slow one has moved on, whatever it mixed. A
    neighbour that stays behind `limit_s` (dead, not yet removed; finished ones are ahead) is not
    waited for again until a newer share of it comes in.
    """

    def __init__(self, lag: int = 1, limit_s: float = 1.0) -> None:
        self.lag = lag
        self.limit_s = limit_s
        self.waits = 0  # steps that began after waiting for a neighbour behind
        self.timeouts = 0  # ... and that went on without it
        self._silent: dict[str, int] = {}  # neighbour -> the step it stayed at

    def wait(self, peer: PushSumPeer, topology: str, members: int, step: int, *, serve: Callable[[], None],
             should_stop: Callable[[], bool]) -> set[str]:
        """Wait until every in-neighbour heard from has a share of step ``step - slack`` or later in
        (slack: `lag` plus the rounds between its visits, less one); returns those still behind."""
        rounds = revisit_rounds(topology, members)
        if rounds is None:  # random graph: a peer may be silent to this one for any number of rounds
            return set()
        floor = step - (self.lag + rounds - 1)

        def behind() -> set[str]:
            heard = peer.heard()
            self._silent = {p: s for p, s in self._silent.items() if heard.get(p, -1) == s}
            return {p for p, s in heard.items() if s < floor and p not in self._silent}

        late = behind()
        if not late:
            return set()
        self.waits += 1
        deadline = time.monotonic() + self.limit_s
        while late and time.monotonic() < deadline and not should_stop():
            serve()
            peer.heard(timeout=0.005)
            late = behind()
        if late:
            self.timeouts += 1
            heard = peer.heard()
            self._silent.update({p: heard[p] for p in late})
        return late
