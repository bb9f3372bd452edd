"""Scaled sign with the momentum on the worker trains like `none` with three async workers."""

from __future__ import annotations

import statistics

from gossamer.core.experiment import Experiment
from tests._async_sim import simulate


def test_sign_with_momentum_trains_within_a_point_of_none_with_three_async_workers() -> None:
    # In-process async (tests/_async_sim.py), digits MLP, lr 0.05, momentum 0.9, 1500 steps, seeds 0-2, the
    # mean over the seeds. The mean-scaled sign reached 0.956 here against none's
    # 0.978 on seed 0 (the CLI sim over 3 seeds: 0.956 against 0.980): error feedback lagged behind a sign sending
    # ~0.8 of its input's norm. The rms scale capped at 1.5 x the mean (SignCodec) reached 0.975 on seed 0. With
    # the 1-D parameters as fp32 (CodecEntry.dense_vectors) seed 0 gives 0.953 and seeds 1-7 0.967-0.983 (mean
    # over 8 seeds 0.974, none's 0.977, the scale alone 0.975 over 7): one seed is not the criterion.
    exp = dict(name="s", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data", mode="async",
               lr=0.05, momentum=0.9, num_ps_shards=2, total_steps=1500)
    none = statistics.fmean(simulate(Experiment(**exp, seed=s, compression="none")) for s in range(3))
    sign = statistics.fmean(simulate(Experiment(**exp, seed=s, compression="sign")) for s in range(3))
    print(f"sign {sign:.4f} vs none {none:.4f} (mean of seeds 0-2)")
    assert sign >= none - 0.01, (sign, none)
