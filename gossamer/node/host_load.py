"""How much CPU this host has to spare right now, from /proc/stat."""

from __future__ import annotations

import asyncio
import os

__all__ = ["cpu_times", "idle_cpus", "spare_cpus"]


def cpu_times(stat: str) -> tuple[int, int]:
    """(idle, total) jiffies of the host from the text of /proc/stat (idle counts iowait)."""
    fields = stat.splitlines()[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError("/proc/stat does not start with the 'cpu' line")
    values = [int(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is in user already
    busy_and_idle = values[:8]
    return values[3] + (values[4] if len(values) > 4 else 0), sum(busy_and_idle)


def idle_cpus(before: tuple[int, int], after: tuple[int, int], ncpu: int) -> float:
    """Cores idle on average between two `cpu_times` readings."""
    total = after[1] - before[1]
    if total <= 0:
        return 0.0
    return ncpu * max(0, after[0] - before[0]) / total


async def spare_cpus(window_s: float = 1.0) -> float:
    """Cores this host left idle over the next `window_s` (all of them where /proc/stat cannot be read)."""
    ncpu = os.cpu_count() or 1
    try:
        with open("/proc/stat") as f:
            before = cpu_times(f.read())
        await asyncio.sleep(window_s)
        with open("/proc/stat") as f:
            after = cpu_times(f.read())
    except (OSError, ValueError):
        return float(ncpu)
    return idle_cpus(before, after, ncpu)
