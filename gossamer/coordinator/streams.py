"""The nodes' assignment streams: which to wake at a change, and which are open now."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class AssignmentStreams:
    """Per-node wake-up events of WatchAssignments streams, the nodes whose stream holds roles, open counts."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}  # node id -> its stream's wake-up
        self._holding: set[str] = set()  # nodes whose stream last sent some roles
        self._open: dict[str, int] = {}  # node id -> its streams open now

    def event(self, node_id: str) -> asyncio.Event:
        """Set at the next change that may touch `node_id`'s assignments: take it before reading them."""
        return self._events.setdefault(node_id, asyncio.Event())

    def sent(self, node_id: str, held: bool) -> None:
        """`node_id`'s stream sent a set of assignments: some roles (`held`) or none."""
        if held:
            self._holding.add(node_id)
        else:
            self._holding.discard(node_id)

    def wake(self, with_roles: Iterable[str]) -> None:
        """Wake the streams of nodes `with_roles` (in an active experiment) and of those whose stream holds roles.

        An idle node's empty set changes only once it gets a role, so a join among 10,000 idle
        nodes wakes none of them (waking every stream made each join cost O(nodes)).
        """
        for node_id in self._holding.union(with_roles):
            if (event := self._events.pop(node_id, None)) is not None:
                event.set()

    def wake_exactly(self, node_ids: Iterable[str]) -> None:
        """Wake the streams of `node_ids` only (a change no other node's assignments can show)."""
        for node_id in node_ids:
            if (event := self._events.pop(node_id, None)) is not None:
                event.set()

    def opened(self, node_id: str) -> None:
        self._open[node_id] = self._open.get(node_id, 0) + 1

    def closed(self, node_id: str) -> None:
        if (left := self._open.get(node_id, 0) - 1) > 0:
            self._open[node_id] = left
        else:
            self._open.pop(node_id, None)

    def is_open(self, node_id: str) -> bool:
        return node_id in self._open
