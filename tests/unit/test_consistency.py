"""SSP gate: clocks, held replies, releases, staleness histograms and lr scaling."""

from __future__ import annotations

import pytest

from gossamer.core.errors import ConfigError
from gossamer.paramserver.consistency import SSPGate, lr_factor


def gate(s, **kw) -> SSPGate[str]:
    g: SSPGate[str] = SSPGate(s, **kw)
    for w in ("a", "b", "c"):
        g.join(w, 0.0)
    return g


def apply_and_gate(g: SSPGate[str], w: str, now: float, version: int = 0, basis: int = 0):
    rec = g.on_apply(w, version=version, basis=basis, now=now)
    if g.must_wait(w):
        g.hold(w, f"reply-{w}", now)
        return rec, []
    return rec, [(w, f"reply-{w}")] + g.release(now)


def test_fast_worker_is_held_once_it_leads_the_slowest_by_more_than_s():
    g = gate(1)
    _, out = apply_and_gate(g, "a", 0.0)
    assert out == [("a", "reply-a")]  # a at 1, min 0: lead 1 <= s
    _, out = apply_and_gate(g, "a", 1.0)
    assert out == [] and g.held_count() == 1  # a at 2, min 0
    apply_and_gate(g, "b", 2.0)
    _, out = apply_and_gate(g, "c", 3.0)  # min becomes 1: a (2) may go
    assert ("a", "reply-a") in out
    assert g.waits["a"] == 1 and g.wait_seconds["a"] == pytest.approx(2.0)


def test_recorded_lead_never_exceeds_the_bound_when_replies_are_gated():
    g = gate(2)
    ready = {"a", "b", "c"}
    for t in range(300):
        # "a" pushes every tick, "b" every 3rd, "c" every 7th - but only when not held.
        for w, every in (("a", 1), ("b", 3), ("c", 7)):
            if w in ready and t % every == 0:
                ready.discard(w)
                _, out = apply_and_gate(g, w, float(t))
                ready.update(name for name, _ in out)
    assert max(g.lead_histogram) <= 2
    assert g.waits["a"] > 0


def test_fully_async_never_holds():
    g = gate(None)
    for t in range(10):
        _, out = apply_and_gate(g, "a", float(t))
        assert out
    assert not g.waits and g.held_count() == 0


def test_leave_of_the_slowest_releases_waiters():
    g = gate(0)
    _, out = apply_and_gate(g, "a", 0.0)
    assert out == []
    g.leave("b", 1.0)
    released = g.leave("c", 2.0)
    assert released == [("a", "reply-a")]


def test_silent_worker_times_out_of_the_active_set_and_releases_waiters():
    g = gate(0, worker_timeout_s=5.0)
    apply_and_gate(g, "a", 0.0)
    g.touch("b", 4.0)
    dead, released = g.expire(6.0)
    assert dead == ["c"] and released == []
    g.on_apply("b", version=1, basis=1, now=6.5)
    assert g.release(6.5) == [("a", "reply-a")]


def test_late_joiner_starts_level_with_the_slowest():
    g = gate(1)
    for w in ("a", "b", "c"):
        for _ in range(3):
            g.on_apply(w, version=0, basis=0, now=0.0)
    g.join("d", 1.0)
    assert g.clock("d") == 3 and not g.must_wait("a")


def test_version_staleness_and_lr_factor_are_recorded():
    g = gate(None, lr_staleness_scaling=True)
    rec = g.on_apply("a", version=10, basis=6, now=0.0)
    assert rec.version_staleness == 4 and rec.lr_factor == pytest.approx(0.25)
    assert g.version_staleness_histogram[4] == 1
    assert lr_factor(0) == 1.0 and lr_factor(1) == 1.0
    assert gate(None).on_apply("a", version=10, basis=6, now=0.0).lr_factor == 1.0


def test_negative_staleness_is_a_config_error():
    with pytest.raises(ConfigError, match="staleness"):
        SSPGate(-1)


def test_a_silent_worker_stops_holding_the_others_back_after_a_few_of_its_steps() -> None:
    g: SSPGate[str] = SSPGate(1, suspect_floor_s=0.1)
    g.join("a", 0.0)
    g.join("b", 0.0)
    for t in range(5):  # both step every 0.05 s
        for w in ("a", "b"):
            g.on_apply(w, version=0, basis=0, now=t * 0.05)
    # b goes silent (killed); a runs ahead and would wait on b forever under plain SSP.
    g.on_apply("a", version=0, basis=0, now=0.25)
    g.on_apply("a", version=0, basis=0, now=0.30)
    assert g.must_wait("a", now=0.30)
    assert g.suspects(0.45) == ["b"] and not g.must_wait("a", now=0.45)
    # b speaks again: it is re-floored to a's clock, not left far behind.
    g.touch("b", now=1.0)
    assert g.clock("b") == g.clock("a")


def test_a_worker_killed_between_hello_and_its_first_push_is_suspected_at_the_others_pace() -> None:
    g: SSPGate[str] = SSPGate(1, suspect_floor_s=0.1)
    for w in ("a", "b"):
        g.join(w, 0.0)
    for t in range(5):  # a and b step every 0.05 s
        for w in ("a", "b"):
            g.on_apply(w, version=0, basis=0, now=t * 0.05)
    g.join("late", 0.21)  # HELLO at the slowest clock, then killed before its first push
    for t in (0.25, 0.30):
        for w in ("a", "b"):
            g.on_apply(w, version=0, basis=0, now=t)
    assert g.must_wait("a", now=0.30)  # within its grace SSP holds a and b back
    # 3 x the others' 0.05 s pace later it no longer does (not its 30 s lease).
    assert g.suspects(0.45) == ["late"] and not g.must_wait("a", now=0.45)
    # It was only slow after all: its first push re-floors it to the slowest other clock.
    g.on_apply("late", version=0, basis=0, now=0.5)
    assert g.clock("late") == g.clock("a") + 1


def test_at_the_start_nobody_has_a_pace_so_nobody_is_suspected() -> None:
    g: SSPGate[str] = SSPGate(0, suspect_floor_s=0.1)
    for w in ("a", "b"):
        g.join(w, 0.0)
    g.on_apply("a", version=0, basis=0, now=1.0)  # b's first step is slow (a big model)
    assert g.must_wait("a", now=1.0)
    g.hold("a", "reply-a", 1.0)
    assert g.suspects(5.0) == [] and g.must_wait("a", now=5.0)
