"""Role log files' names and size bounds: what a node agent writes and serves, and what the coordinator asks it for."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LOG_TAIL", "MAX_LISTED", "TRACEBACK_MAX", "Stem", "log_stem", "parse_stem"]

#: At most this many bytes of a log in one answer (the tail, or from a follower's offset).
LOG_TAIL = 64 << 10
#: The last this many bytes of a traceback are kept and answered.
TRACEBACK_MAX = 16 << 10
#: Role logs one answer lists (newest first).
MAX_LISTED = 64
_STEM = re.compile(r"(worker)-(\d{1,6})\.rank(\d{1,4})|(ps)-(\d{1,6})(\.backup)?")


@dataclass(frozen=True)
class Stem:
    """The role a log file is of: a worker's local rank, or a shard replica."""

    worker: bool
    index: int
    local_rank: int = 0
    replica: int = 0

    @property
    def name(self) -> str:
        """The file name without suffix: `worker-3.rank0`, `ps-1`, `ps-1.backup`."""
        if self.worker:
            return f"worker-{self.index}.rank{self.local_rank}"
        return f"ps-{self.index}" + (".backup" if self.replica else "")


def log_stem(*, worker: bool, index: int, local_rank: int = 0, replica: int = 0) -> str:
    """A role's log file name without suffix (`Stem.name`)."""
    return Stem(worker=worker, index=index, local_rank=local_rank if worker else 0,
                replica=0 if worker else int(bool(replica))).name


def parse_stem(stem: str) -> Stem | None:
    """The role a `log_stem` names, None for any other name."""
    m = _STEM.fullmatch(stem)
    if m is None:
        return None
    if m.group(1):
        return Stem(worker=True, index=int(m.group(2)), local_rank=int(m.group(3)))
    return Stem(worker=False, index=int(m.group(5)), replica=1 if m.group(6) else 0)
