"""Which of several coordinators on one PostgreSQL database leads: the holder of an advisory lock, checked by term."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gossamer.coordinator.pg_store import PgStore

log = logging.getLogger(__name__)

#: A standby asks for the lock this often: with PostgreSQL freeing a dead leader's lock as its
#: connection drops, this bounds the failover's first part.
POLL_S = 0.2
#: A leader reads its term back this often, so one that lost its session or term stops acting
#: even when nothing is written.
CHECK_S = 0.5


class Election:
    """Stand by until the lock is ours, then lead until the term moves on or the session ends.

    `on_lead(term)` runs once when this process takes the lead; `on_lost(why)` once when it
    loses it (from the check here, or from a fenced write in the store). Losing is final: a
    deposed leader exits and is started again as a standby (`coordinator serve` exits 3).
    """

    def __init__(self, store: PgStore, address: str, on_lead: Callable[[int], Awaitable[None]],
                 on_lost: Callable[[str], None]) -> None:
        self.store = store
        self.address = address
        self.on_lead = on_lead
        self.on_lost = on_lost
        self.term = 0
        self.leader = ""  # the leader's address as last read ("" before any led)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One try now (a lone coordinator leads when this returns), then keep trying in the background."""
        await self._attempt()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _attempt(self) -> bool:
        term = await self.store.try_lead(self.address)
        if not term:
            _, self.leader = await self.store.leader()
            return False
        self.term, self.leader = term, self.address
        self.store.on_lost = self.on_lost
        log.info("took the lead as term %d at %s", term, self.address)
        await self.on_lead(term)
        return True

    async def _run(self) -> None:
        while not self.term:
            await asyncio.sleep(POLL_S)
            try:
                await self._attempt()
            except Exception as e:  # noqa: BLE001 — a standby has nothing to protect: reconnect, keep trying
                log.warning("standby: state database unreachable (%s); reconnecting", str(e).strip()[:200])
                await asyncio.sleep(1.0)
                try:
                    await asyncio.to_thread(self.store.reconnect)
                except Exception as again:  # noqa: BLE001
                    log.warning("standby: reconnect failed (%s)", str(again).strip()[:200])
        while await self.store.still_leading():
            await asyncio.sleep(CHECK_S)
        self.on_lost("the term moved on or the state database session ended")

    def deposed(self) -> None:
        """This process lost the lead: it no longer knows who leads."""
        self.term, self.leader = 0, ""
