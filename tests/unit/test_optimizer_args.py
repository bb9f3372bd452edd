"""`optimizer` by torch's class name and `optimizer_args` (AdamW's betas and eps) reach the shards and the workers."""

from __future__ import annotations

import pytest
import torch

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.paramserver.optimizer import build_optimizer
from gossamer.paramserver.shard_config import ShardConfig
from gossamer.training.local_optimizer import inner_optimizer

BASE = {"name": "x", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"}


def test_adamw_by_class_name_with_its_betas_is_what_the_shards_and_the_inner_steps_run() -> None:
    exp = Experiment.from_dict({**BASE, "mode": "sync", "optimizer": "torch.optim.AdamW",
                                "optimizer_args": {"betas": [0.9, 0.95], "eps": 1e-6}})
    assert exp.optimizer == "adamw" and Experiment.from_json(exp.to_json()) == exp
    shard = ShardConfig.for_experiment(exp, "e", 0).optimizer
    assert shard.betas == (0.9, 0.95) and shard.eps == 1e-6
    opt = build_optimizer(shard, [torch.zeros(3, requires_grad=True)])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-6
    diloco = Experiment.from_dict({**BASE, "mode": "diloco", "optimizer_args": {"betas": [0.9, 0.95]}})
    inner = inner_optimizer(diloco, [torch.zeros(3, requires_grad=True)])
    assert isinstance(inner, torch.optim.AdamW) and inner.defaults["betas"] == (0.9, 0.95)


@pytest.mark.parametrize(("fields", "says"), [
    ({"optimizer": "torch.optim.Adagrad"}, "write your loop as a train function"),
    ({"optimizer": "mypkg.opt:Lion"}, "write your loop as a train function"),
    ({"optimizer": "adamw", "optimizer_args": {"betaz": [0.9, 0.95]}}, "did you mean 'betas'"),
    ({"optimizer": "adamw", "optimizer_args": {"lr": 0.1}}, "a field of its own"),
    ({"optimizer": "adamw", "optimizer_args": {"betas": [0.9, 1.5]}}, "two numbers in [0, 1)"),
    ({"optimizer": "adamw", "optimizer_args": {"eps": 0}}, "eps must be"),
    ({"optimizer": "sgd", "optimizer_args": {"betas": [0.9, 0.95]}}, "not an argument of sgd"),
])
def test_an_unknown_class_or_argument_is_refused_at_submit_naming_the_field(fields: dict[str, object],
                                                                            says: str) -> None:
    with pytest.raises(ConfigError) as e:
        Experiment.from_dict({**BASE, "mode": "async", **fields})
    assert e.value.field in ("optimizer", "optimizer_args") and says in str(e.value), str(e.value)
