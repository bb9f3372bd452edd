"""Scaled sign with the momentum on the worker trains like `none` with three async workers (issue 17)."""

from __future__ import annotations

from gossamer.experiment import Experiment
from tests._async_sim import simulate


def test_sign_with_momentum_trains_within_a_point_of_none_with_three_async_workers() -> None:
    # In-process async (tests/_async_sim.py), digits MLP, lr 0.05, momentum 0.9, 1500 steps, seed 0.
    # The mean-scaled sign reached 0.956 here against none's 0.978 (the CLI sim over 3 seeds: 0.956 against 0.980):
    # error feedback lagged behind a sign sending ~0.8 of its input's norm. The rms scale capped at
    # 1.5 x the mean (SignCodec) reaches 0.975 (the CLI sim over 3 seeds: 0.982).
    exp = dict(name="s", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data", mode="async",
               lr=0.05, momentum=0.9, num_ps_shards=2, total_steps=1500, seed=0)
    none = simulate(Experiment(**exp, compression="none"))
    sign = simulate(Experiment(**exp, compression="sign"))
    print(f"sign {sign:.4f} vs none {none:.4f}")
    assert sign >= none - 0.01, (sign, none)
