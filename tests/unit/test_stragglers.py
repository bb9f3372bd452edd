"""The straggler rule (slower than half the median step rate) and the coordinator's per-node step rates."""

from __future__ import annotations

import pytest

from gossamer.coordinator.stragglers import StepRates, stragglers


def test_a_worker_slower_than_half_the_median_is_a_straggler() -> None:
    assert stragglers({"a": 10.0, "b": 9.0, "c": 11.0, "slow": 4.4}) == {"slow"}  # median 9.5, cut 4.75


def test_exactly_half_the_median_is_not_a_straggler() -> None:
    assert stragglers({"a": 10.0, "b": 10.0, "c": 5.0}) == set()


def test_one_worker_alone_is_never_a_straggler() -> None:
    assert stragglers({"only": 0.1}) == set()
    assert stragglers({}) == set()


def test_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    # median (6 + 10) / 2 = 8, cut 4: the lower middle (6) would let 3.9 pass, the upper (10) flag 4.5
    assert stragglers({"a": 3.9, "b": 6.0, "c": 10.0, "d": 12.0}) == {"a"}
    assert stragglers({"a": 4.5, "b": 6.0, "c": 10.0, "d": 12.0}) == set()


def test_several_stragglers_are_all_flagged() -> None:
    rates = {f"fast{i}": 20.0 for i in range(5)} | {"slow0": 1.0, "slow1": 9.9}
    assert stragglers(rates) == {"slow0", "slow1"}


def test_step_rate_is_steps_over_the_window_on_the_coordinator_clock() -> None:
    rates = StepRates(window_s=10.0)
    for t in range(31):  # 5 steps/s, reported once a second
        rates.observe("e", "n", steps=5.0 * t, now=1000.0 + t)
    assert rates.rate("e", "n", now=1030.0) == pytest.approx(5.0)


def test_rate_is_unknown_until_two_reports_span_enough_time() -> None:
    rates = StepRates(window_s=10.0, min_span_s=2.0)
    rates.observe("e", "n", steps=0.0, now=0.0)
    assert rates.rate("e", "n", now=0.5) is None
    rates.observe("e", "n", steps=10.0, now=1.0)
    assert rates.rate("e", "n", now=1.0) is None
    rates.observe("e", "n", steps=20.0, now=2.0)
    assert rates.rate("e", "n", now=2.0) == pytest.approx(10.0)
    assert rates.rate("e", "other", now=2.0) is None


def test_a_worker_that_stops_reporting_slows_down() -> None:
    rates = StepRates(window_s=10.0)
    for t in range(11):
        rates.observe("e", "n", steps=10.0 * t, now=float(t))
    assert rates.rate("e", "n", now=10.0) == pytest.approx(10.0)
    # the last 10 s: steps 50 -> 100 between t=5 and t=10, then 5 s of nothing
    assert rates.rate("e", "n", now=15.0) == pytest.approx(5.0)


def test_a_restarted_worker_starts_its_counter_over() -> None:
    rates = StepRates(window_s=10.0)
    for t in range(5):
        rates.observe("e", "n", steps=1000.0 + 10 * t, now=float(t))
    for t in range(5, 9):
        rates.observe("e", "n", steps=2.0 * (t - 5), now=float(t))
    assert rates.rate("e", "n", now=8.0) == pytest.approx(2.0)


def test_rates_of_one_experiment_are_forgotten_when_it_ends() -> None:
    rates = StepRates()
    for t in range(4):
        rates.observe("e1", "n", steps=float(t), now=float(t))
        rates.observe("e2", "n", steps=float(t), now=float(t))
    rates.forget("e1")
    assert rates.rates("e1", ["n"], now=3.0) == {}
    assert rates.rates("e2", ["n"], now=3.0) == {"n": pytest.approx(1.0)}


def test_history_stays_bounded_by_the_window() -> None:
    rates = StepRates(window_s=10.0)
    for t in range(10_000):
        rates.observe("e", "n", steps=float(t), now=float(t))
    assert len(rates._seen[("e", "n")]) <= 12
