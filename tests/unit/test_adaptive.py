"""Adaptive codec choice: least lossy within the transfer budget, more aggressive on a slow link."""

from __future__ import annotations

from gossamer.compression.adaptive import LADDER, AdaptiveConfig, AdaptivePolicy

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
    p.observe_transfer(10**6, 10**6 / 1e6)  # throttled
    assert p.decide()
    slow = p.mean_level()
    p.observe_transfer(10**6, 10**6 / 10e9)  # lifted
    assert p.decide()
    assert slow > fast and p.mean_level() == fast


def test_no_decision_before_measurements() -> None:
    p = AdaptivePolicy(TENSORS, RATIO)
    assert not p.decide() and set(p.choices().values()) == {"none"}
