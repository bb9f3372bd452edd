"""Rebuilding a shard that lost every replica and found no checkpoint from the freshest worker's copy of its values.

Every PS worker holds the values it last pulled (and the shard version they were at). A shard
in seeding refuses PULL and PUSH with `SEEDING`; a worker answers that with a SEED carrying its
copy of the shard's chunks, then asks again. Once the window after the first complete copy has
passed (or every member has sent one), the shard takes the copy at the highest version. Its
optimizer state (momentum) is not in the copies: it starts afresh. With no copy before the
deadline the shard reports that it has no source, and the coordinator fails the run.

Each copy (async) carries every worker's applied clock in the state it is of (`ParamsMeta.applied`):
the taken copy's become the shard's, and each other copy says how many of its sender's updates,
acknowledged to it, the taken one lacks (`lost`): the versions lost, counted exactly for every
worker that sent a copy. A worker that sent none is counted as it pushes again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

__all__ = ["Rebuilt", "Seed", "Seeding"]

logger = logging.getLogger(__name__)


@dataclass
class Seed:
    """One worker's copy of the shard, gathered from its local ranks' SEEDs."""

    sender: str
    version: int
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Every worker's applied clock in the copy's state (of its oldest part); None: a part came without.
    applied: dict[str, int] | None = None
    #: The sender's own last update acknowledged to it (its clock in the newest part's state).
    acked: int = -1


@dataclass(frozen=True)
class Rebuilt:
    """How a rebuild from the workers' copies ended: from `sender`'s copy at `version` ("" and 0: no copy came)."""

    sender: str
    version: int
    #: Versions lost, counted so far: every copy's sender's acknowledged updates the taken copy lacks.
    lost: int = 0
    #: Why `lost` is not the exact count yet ("": it is).
    unknown: str = ""


class Seeding:
    """Collects workers' copies for `chunks` from `started` on; `choice` says when and which to take."""

    def __init__(self, chunks: dict[int, int], *, started: float, window_s: float, deadline_s: float) -> None:
        """`chunks`: chunk index -> numel of every chunk of the shard."""
        self.chunks = chunks
        self.started = started
        self.window_s = window_s
        self.deadline_s = deadline_s
        self.seeds: dict[str, Seed] = {}
        self._first_complete: float | None = None

    def offer(self, sender: str, version: int, values: dict[int, torch.Tensor], now: float,
              applied: dict[str, int] | None = None) -> None:
        """A SEED: part (one local rank's chunks) or all of `sender`'s copy, at shard `version`, whose state
        held `applied` (worker -> clock; None: not said)."""
        for idx, t in values.items():
            if idx not in self.chunks or t.dtype != torch.float32 or t.numel() != self.chunks[idx]:
                raise ValueError(f"SEED chunk {idx} does not fit this shard")
            if not torch.isfinite(t).all():
                raise ValueError(f"SEED chunk {idx} is not finite")
        first = sender not in self.seeds
        seed = self.seeds.setdefault(sender, Seed(sender=sender, version=version, applied=applied))
        if applied is None:
            seed.applied = None
        elif seed.applied is not None and (first or version < seed.version):
            seed.applied = dict(applied)
        if applied is not None:
            seed.acked = max(seed.acked, applied.get(sender, -1))
        seed.version = min(seed.version, version)  # ranks that pulled at different versions: the older
        seed.values.update({idx: t.reshape(-1).clone() for idx, t in values.items()})
        if self._first_complete is None and self.complete(seed):
            self._first_complete = now

    def complete(self, seed: Seed) -> bool:
        return set(seed.values) == set(self.chunks)

    def choice(self, now: float, members: frozenset[str] | None) -> Seed | None:
        """The freshest complete copy once the window has passed (or every member sent one); else None."""
        done = [s for s in self.seeds.values() if self.complete(s)]
        if not done or self._first_complete is None:
            return None
        everyone = bool(members) and members is not None and members <= {s.sender for s in done}
        if not everyone and now - self._first_complete < self.window_s:
            return None
        return max(done, key=lambda s: s.version)

    def lost(self, taken: Seed) -> dict[str, int] | None:
        """Per sender of a copy, its acknowledged updates that `taken` (by its clocks) lacks; None: a copy
        came without clocks (sync, or an older worker), so nothing is counted here."""
        if taken.applied is None or any(s.applied is None for s in self.seeds.values()):
            return None
        return {s.sender: max(0, s.acked - taken.applied.get(s.sender, -1)) for s in self.seeds.values()}

    def expired(self, now: float) -> bool:
        """No complete copy came before the deadline: there is no source to rebuild from."""
        return self._first_complete is None and now - self.started > self.deadline_s
