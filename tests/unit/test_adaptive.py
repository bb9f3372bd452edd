"""Adaptive codec choice: least lossy within the transfer budget, more aggressive on a slow link."""

from __future__ import annotations

import pytest

from gossamer.compression.adaptive import (
    LADDER,
    AdaptiveConfig,
    AdaptivePolicy,
    BaseLatency,
    ProbeSchedule,
)
from gossamer.core.errors import ConfigError

RATIO = {"none": 1.0, "bf16": 2.0, "int8": 3.9, "topk:0.1": 6.0, "topk:0.01": 60.0, "topk:0.001": 600.0}
TENSORS = {"big.weight": 100_000, "small.weight": 5_000, "bias": 100}


def _policy(bandwidth_bps: float, compute_s: float = 0.01) -> AdaptivePolicy:
    p = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(decide_every=1))
    p.observe_step(compute_s)
    p.observe_transfer(1_000_000, 1_000_000 / bandwidth_bps)
    p.decide()
    return p


def test_fast_link_keeps_everything_exact() -> None:
    assert set(_policy(10e9).choices().values()) == {"none"}


def test_slow_link_compresses_biggest_tensors_first() -> None:
    p = _policy(5e6)  # budget = 0.2 * 10 ms * 5 MB/s = 10 kB per step
    assert p.predicted_bytes(p.level) <= 10_000
    assert LADDER.index(p.codec("big.weight")) >= LADDER.index(p.codec("small.weight"))
    assert p.codec("bias") in ("none", "bf16")  # tiny tensors are not worth compressing


def test_choice_follows_bandwidth_down_and_back_up() -> None:
    p = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(decide_every=1, smoothing=1.0))
    p.observe_step(0.01)
    p.observe_transfer(10**6, 10**6 / 10e9)
    p.decide()
    fast = p.mean_level()
    p.observe_transfer(10**6, 10**6 / 1e6, now=1.0)  # throttled: held until confirmed
    assert p.drop_pending is not None and not p.decide()
    p.observe_transfer(10**6, 10**6 / 1e6, now=1.1)  # still throttled: a real drop
    assert p.drop_pending is None and p.bandwidth_bps == 1e6
    assert p.decide()
    slow = p.mean_level()
    p.observe_transfer(10**6, 10**6 / 10e9, now=1.2)  # lifted: a faster sample counts at once
    assert p.decide()
    assert slow > fast and p.mean_level() == fast


def test_one_stalled_sample_on_a_fast_link_is_forgotten() -> None:
    """A single probe that hit a scheduling stall must not flip every codec to top-k."""
    p = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(decide_every=1))
    p.observe_step(0.01)
    p.observe_transfer(10**6, 10**6 / 10e9, now=0.0)
    p.decide()
    p.observe_transfer(10**6, 10**6 / 1e6, now=0.1)  # 10000x slower once
    p.observe_transfer(10**6, 10**6 / 8e9, now=0.2)  # and fast again
    assert p.drop_pending is None and p.bandwidth_bps == 10e9
    assert not p.decide() and set(p.choices().values()) == {"none"}


def test_within_the_window_the_best_sample_is_the_estimate() -> None:
    p = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(bandwidth_window_s=3.0))
    p.observe_transfer(100, 100 / 5e6, now=0.0)
    p.observe_transfer(100, 100 / 2e6, now=1.0)  # slower, but not a drop: noise
    assert p.bandwidth_bps == 5e6
    p.observe_transfer(100, 100 / 2e6, now=3.5)  # the 5 MB/s sample has left the window
    assert p.bandwidth_bps == 2e6


def test_probes_cost_at_most_their_share_of_the_link() -> None:
    s = ProbeSchedule(probe_bytes=100_000, share=0.02, max_interval_s=2.0)
    assert s.interval(None) == 0.0  # nothing known yet: probe at the first decision
    assert s.interval(1e9) == pytest.approx(0.005)  # 100 kB is 2% of 5 ms of a 1 GB/s link
    assert s.interval(1e7) == pytest.approx(0.5)
    assert s.interval(1e5) == 2.0  # capped, so a lifted limit is seen within 2 s
    s.probed(now=10.0)
    assert not s.due(1e7, now=10.4) and s.due(1e7, now=10.5)


def test_a_push_that_suddenly_got_slower_brings_the_probe_forward() -> None:
    s = ProbeSchedule(probe_bytes=100_000, max_interval_s=2.0)
    s.probed(now=0.0)
    for _ in range(5):
        s.observe_push(100_000, 0.001)
    s.observe_push(100_000, 0.003)  # 3x: noise, not a change
    assert not s.due(1e5, now=0.1)
    s.observe_push(100_000, 0.05)  # 50x slower per byte than the pushes since the probe
    assert s.due(1e5, now=0.1)
    s.probed(now=0.1)
    assert not s.urgent
    s.observe_push(100_000, 0.05)  # the new normal is judged against pushes after the probe
    assert not s.due(1e5, now=0.2)


def test_probe_schedule_refuses_nonsense() -> None:
    with pytest.raises(ConfigError):
        ProbeSchedule(probe_bytes=0)
    with pytest.raises(ConfigError):
        ProbeSchedule(probe_bytes=1, share=0.0)


def test_no_decision_before_measurements() -> None:
    p = AdaptivePolicy(TENSORS, RATIO)
    assert not p.decide() and set(p.choices().values()) == {"none"}


def test_a_codec_slower_than_sending_raw_bytes_is_never_chosen() -> None:
    # top-k costs 100 ns a value: at 1 GB/s that is 100 bytes of link time, more than the 4
    # bytes of sending the value raw; on a 1 MB/s link it is 0.1 byte and worth it.
    cost = {spec: (100e-9 if spec.startswith("topk") else 0.0) for spec in LADDER}
    fast = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(decide_every=1), cost)
    fast.observe_step(1e-4)  # a budget no codec can meet at 1 GB/s
    fast.observe_transfer(1_000_000, 1e-3)
    fast.decide()
    assert not any(spec.startswith("topk") for spec in fast.choices().values())
    assert fast.codec("big.weight") == "int8"
    slow = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(decide_every=1), cost)
    slow.observe_step(1e-2)
    slow.observe_transfer(1_000_000, 1.0)
    slow.decide()
    assert slow.codec("big.weight").startswith("topk")


def test_codec_time_counts_against_the_budget() -> None:
    costly = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(decide_every=1), {"int8": 200e-9})
    costly.observe_step(0.01)
    costly.observe_transfer(1_000_000, 1_000_000 / 5e6)
    at_int8 = {name: LADDER.index("int8") for name in TENSORS}
    n = sum(TENSORS.values())
    # 200 ns a value on a 5 MB/s link: 1 byte of link time per value on top of the wire bytes.
    assert costly.predicted_bytes(at_int8) == pytest.approx(4 * n / RATIO["int8"] + n * 200e-9 * 5e6)
    costly.decide()
    assert costly.predicted_bytes(costly.level) <= 10_000


def test_after_a_throttle_each_tensor_relaxes_as_far_as_the_tighter_budget_allows() -> None:
    """The exact plan just over the hysteresis budget must not pin every tensor at the top."""
    p = AdaptivePolicy(TENSORS, RATIO, AdaptiveConfig(decide_every=1, smoothing=1.0))
    p.observe_step(0.01)
    p.observe_transfer(10**6, 10**6 / 1e6, now=0.0)  # throttled from the start
    p.decide()
    assert p.codec("big.weight") == LADDER[-1]
    # Lifted to a link where exact values take 90% of the budget: over the 70% hysteresis share.
    exact = 4 * sum(TENSORS.values())
    p.observe_transfer(10**6, 10**6 / (exact / (0.9 * 0.2 * 0.01)), now=10.0)
    assert p.decide()
    budget = 0.2 * 0.01 * p.bandwidth_bps
    assert p.predicted_bytes(p.level) <= 0.7 * budget  # relaxed to the comfortable plan
    assert p.codec("big.weight") in ("bf16", "int8")  # not left at top-k 0.001
    assert not p.decide()  # and stays there: no flapping at the same measurement


def test_base_latency_is_the_least_bare_round_trip_of_its_window() -> None:
    b = BaseLatency(window_s=10.0)
    assert b.observe(0.0003, now=0.0) == 0.0003
    assert b.observe(0.0050, now=1.0) == 0.0003  # a stalled bare trip is not the latency
    assert b.observe(0.0004, now=12.0) == 0.0004  # the old minimum left the window
    assert b.observe(float("nan"), now=13.0) == 0.0004


def test_probes_take_at_most_their_share_of_the_workers_time() -> None:
    s = ProbeSchedule(probe_bytes=128 * 1024, share=0.02, max_interval_s=2.0)
    s.probed(now=0.0, took_s=0.002)  # a 2 ms probe on a 10 GB/s link: bytes alone would allow it at once
    assert not s.due(10e9, now=0.05) and s.due(10e9, now=0.1)
    s.probed(now=1.0, took_s=1.0)  # a very slow probe: still at most `max_interval_s` apart
    assert s.due(10e9, now=3.0)
