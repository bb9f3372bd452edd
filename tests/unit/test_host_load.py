"""Spare CPU from /proc/stat: the idle share of the host's time between two readings, in cores."""

from __future__ import annotations

import asyncio

import pytest

from gossamer.node.host_load import cpu_times, idle_cpus, spare_cpus

STAT = "cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1 2\n"


def _stat(user: int, system: int, idle: int, iowait: int = 0, steal: int = 0) -> str:
    return STAT.format(user=user, system=system, idle=idle, iowait=iowait, steal=steal)


def test_idle_counts_iowait_and_total_leaves_guest_out() -> None:
    # guest (7) is already inside user: counting it again would make the host look busier than it is
    assert cpu_times(_stat(100, 50, 300, iowait=20, steal=30)) == (320, 500)


def test_idle_cores_between_two_readings() -> None:
    before = cpu_times(_stat(100, 100, 100))
    # 2 cores over the window: 300 jiffies busy, 100 idle -> half a core idle
    assert idle_cpus(before, cpu_times(_stat(300, 200, 200)), 2) == pytest.approx(0.5)
    assert idle_cpus(before, cpu_times(_stat(100, 100, 500)), 2) == pytest.approx(2.0)
    assert idle_cpus(before, before, 2) == 0.0  # no time passed: nothing known to be spare


def test_a_file_that_is_not_proc_stat_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu"):
        cpu_times("intr 1 2\n")


def test_spare_cpus_reads_this_host() -> None:
    import os

    spare = asyncio.run(spare_cpus(0.2))
    assert 0.0 <= spare <= (os.cpu_count() or 1) + 1e-6
