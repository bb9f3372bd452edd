"""Learning-rate schedules: warm-up then constant/linear/cosine, on the shards and validated."""

from __future__ import annotations

import math

import pytest
import torch

from gossamer import Experiment
from gossamer.core.errors import ConfigError
from gossamer.core.lr_schedule import lr_multiplier
from gossamer.paramserver.local import LocalShards
from gossamer.paramserver.shard_client import ShardClient


def test_constant_is_one_everywhere() -> None:
    assert all(lr_multiplier(s, 100) == 1.0 for s in range(120))


def test_warmup_ramps_linearly_to_the_base_lr() -> None:
    assert [lr_multiplier(s, 100, "constant", 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_is_monotone_positive_and_ends_near_zero(schedule: str) -> None:
    f = [lr_multiplier(s, 1000, schedule, 50) for s in range(50, 1000)]
    assert f[0] == 1.0
    assert all(a >= b for a, b in zip(f, f[1:], strict=False))
    assert 0 < f[-1] < 0.01
    # a late update (re-formed sync step, straggler) never gets a negative or growing lr
    assert lr_multiplier(1200, 1000, schedule, 50) == f[-1]


def test_cosine_is_half_way_at_the_middle_of_the_decay() -> None:
    assert lr_multiplier(550, 1050, "cosine", 50) == pytest.approx(0.5)
    assert lr_multiplier(550, 1050, "linear", 50) == pytest.approx(0.5)


def test_experiment_validates_schedule_fields() -> None:
    base = dict(name="x", model="m:f", dataset="d:f", total_steps=100)
    with pytest.raises(ConfigError, match="lr_schedule"):
        Experiment(**base, lr_schedule="step")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="warmup_steps"):
        Experiment(**base, warmup_steps=100)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="warmup_steps"):
        Experiment(**base, warmup_steps=-1)  # type: ignore[arg-type]
    exp = Experiment(**base, lr_schedule="cosine", warmup_steps=10)  # type: ignore[arg-type]
    assert Experiment.from_json(exp.to_json()) == exp


def test_shard_applies_the_schedule_per_version() -> None:
    """Plain SGD on a real shard: each version moves the parameters by lr * multiplier(version)."""
    exp = Experiment(name="s", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                     lr=0.1, lr_schedule="cosine", warmup_steps=2, total_steps=6, lr_staleness_scaling=False)
    shards = LocalShards(exp)
    client = ShardClient(experiment=shards.experiment_id, sender="w0", plan=shards.plan, endpoints=shards.endpoints)
    try:
        before = shards.flat()
        ones = {c.index: torch.ones(c.numel) for c in shards.plan.chunks}
        moved = []
        for clock in range(6):
            res = client.push_pull(ones, clock=clock, basis=client.pull().versions)
            now = torch.zeros(shards.plan.total_numel)
            shards.plan.scatter(now, res.values)
            moved.append(float((before - now).mean()))
            before = now
        want = [0.1 * lr_multiplier(v, 6, "cosine", 2) for v in range(6)]
        assert moved == pytest.approx(want, rel=1e-4)
        assert not math.isclose(moved[2], moved[5])
    finally:
        client.close()
        shards.close()


def test_shard_applies_the_linear_scaling_rule() -> None:
    """A real shard steps by lr x batch_size / base_batch_size when `lr_scaling = "linear"`."""
    moved = {}
    for scaling in ("none", "linear"):
        exp = Experiment(name="s", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                         lr=0.1, batch_size=64, base_batch_size=16, lr_scaling=scaling, total_steps=4,
                         lr_staleness_scaling=False)
        shards = LocalShards(exp)
        client = ShardClient(experiment=shards.experiment_id, sender="w0", plan=shards.plan,
                             endpoints=shards.endpoints)
        try:
            before = shards.flat()
            res = client.push_pull({c.index: torch.ones(c.numel) for c in shards.plan.chunks}, clock=0,
                                   basis=client.pull().versions)
            now = torch.zeros(shards.plan.total_numel)
            shards.plan.scatter(now, res.values)
            moved[scaling] = float((before - now).mean())
        finally:
            client.close()
            shards.close()
    assert moved["none"] == pytest.approx(0.1, rel=1e-4)
    assert moved["linear"] == pytest.approx(0.4, rel=1e-4)  # 64 / 16 = 4x the lr
