"""How a leaving node splits its grace: the Leave always keeps one whole attempt."""

from __future__ import annotations

import pytest

from gossamer.node.leave import ATTEMPT_S, GraceSplit


def test_a_ten_second_grace_leaves_the_leave_a_whole_attempt_after_the_workers_use_theirs() -> None:
    split = GraceSplit.of(10.0)
    workers = split.workers_s(10.0)
    assert workers == pytest.approx(4.5)  # not 0.6 of the grace: the Leave and the shards' reserve come first
    now = workers  # the workers took all of theirs
    assert split.checkpoints_s(10.0 - now) == pytest.approx(0.0)
    assert split.leave_until(now, 10.0) - now >= ATTEMPT_S


def test_a_long_grace_keeps_the_workers_share() -> None:
    split = GraceSplit.of(30.0)
    assert (split.reserve_s, split.leave_s) == (5.0, ATTEMPT_S)
    assert split.workers_s(30.0) == pytest.approx(18.0)
    assert split.checkpoints_s(12.0) == pytest.approx(2.0)
    assert split.leave_until(20.0, 30.0) == pytest.approx(25.0)  # the grace less the reserve


def test_no_grace_still_sends_the_leave_once() -> None:
    split = GraceSplit.of(0.0)
    assert split.workers_s(0.0) == split.checkpoints_s(0.0) == 0.0
    assert split.leave_until(100.0, 100.0) == pytest.approx(101.0)


def test_a_late_leave_still_gets_its_attempt_past_the_deadline() -> None:
    split = GraceSplit.of(10.0)
    assert split.leave_until(9.5, 10.0) == pytest.approx(9.5 + ATTEMPT_S)
