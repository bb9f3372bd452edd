"""Which experiments run through a train function: `old_path_reason` names what keeps one on the mode trainers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.core.import_check import resolve
from gossamer.core.modes import Mode, rows
from gossamer.core.train_path import (
    BUILTIN_TRAIN,
    builtin_train_function,
    old_path_reason,
    shards_step_optimizer,
)
from gossamer.paramserver.shard_config import ShardConfig

DIGITS: dict[str, Any] = {"name": "d", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"}


def test_a_builtin_gossip_experiment_runs_as_the_builtin_train_function_with_its_fields_kept() -> None:
    exp = Experiment(**DIGITS, mode="gossip", num_ps_shards=0, lr=0.1, momentum=0.9)
    assert old_path_reason(exp) == ""
    routed = builtin_train_function(exp)
    assert routed.train == BUILTIN_TRAIN
    assert (routed.model, routed.dataset, routed.lr, routed.momentum) == (exp.model, exp.dataset, 0.1, 0.9)
    assert Experiment.from_json(routed.to_json()) == routed  # it travels to the roles as it is


@pytest.mark.parametrize(("fields", "said"), [
    ({"mode": "diloco"}, "diloco"),
    ({"mode": "diloco", "outer_step": "gossip", "num_ps_shards": 0}, "diloco/gossip"),
    ({"mode": "gossip", "num_ps_shards": 0, "precision": "fp16"}, "fp16"),
    ({"mode": "async", "precision": "fp16"}, "fp16"),
    ({"mode": "async", "parallelism": "fsdp"}, "fsdp"),
])
def test_what_the_train_function_trainers_do_otherwise_keeps_the_old_path_and_says_why(
        fields: dict[str, Any], said: str) -> None:
    exp = Experiment(**DIGITS, **fields)
    assert said in old_path_reason(exp)
    assert builtin_train_function(exp) is exp


def test_a_builtin_async_experiment_runs_as_the_builtin_train_function_with_the_same_shards() -> None:
    exp = Experiment(**DIGITS, mode="async", optimizer="adamw", lr=3e-3, lr_schedule="cosine", warmup_steps=5,
                     lr_scaling="linear", staleness=4)
    assert old_path_reason(exp) == ""
    routed = builtin_train_function(exp)
    assert routed.train == BUILTIN_TRAIN
    # The shards step the experiment's optimizer on the pushed gradients either way (its schedule, its lr).
    assert shards_step_optimizer(exp) and shards_step_optimizer(routed)
    old, new = ShardConfig.for_experiment(exp, "e", 0), ShardConfig.for_experiment(routed, "e", 0)
    assert new.lr_linear is not None and new.lr_linear(4) == old.lr_linear(4)  # type: ignore[misc]
    assert dataclasses.replace(new, lr_linear=None) == dataclasses.replace(old, lr_linear=None)
    assert (new.optimizer.name, new.lr_schedule, new.lr_staleness_scaling) == ("adamw", "cosine", True)


def test_a_builtin_sync_experiment_runs_as_the_builtin_train_function_and_its_shards_hold_the_optimizer() -> None:
    exp = Experiment(**DIGITS, mode="sync", global_batch_size=64, momentum=0.9, compression="int8")
    routed = builtin_train_function(exp)
    assert old_path_reason(exp) == "" and routed.train == BUILTIN_TRAIN  # compressed too: the shards step on it
    old, new = ShardConfig.for_experiment(exp, "e", 0), ShardConfig.for_experiment(routed, "e", 0)
    assert dataclasses.replace(new, lr_linear=None) == dataclasses.replace(old, lr_linear=None)
    assert not new.reduce and new.optimizer.momentum == 0.9


def test_a_users_sync_train_function_has_the_shards_answer_the_mean() -> None:
    cfg = ShardConfig.for_experiment(Experiment(name="u", train="tests.integration._user_loop:train", mode="sync"),
                                     "e", 0)
    assert cfg.reduce and (cfg.optimizer.name, cfg.optimizer.lr) == ("sgd", 1.0)


def test_a_users_async_train_function_steps_on_the_worker_and_the_shards_add_its_change() -> None:
    exp = Experiment(name="u", train="tests.integration._user_loop:train", mode="async")
    assert not shards_step_optimizer(exp)
    cfg = ShardConfig.for_experiment(exp, "e", 0)
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.lr_schedule) == ("sgd", 1.0, "constant")


@pytest.mark.parametrize("mode", ["gossip", "async", "sync"])
def test_a_ddp_node_of_several_local_ranks_runs_the_builtin_train_function(mode: str) -> None:
    exp = Experiment(**DIGITS, mode=mode, **({"num_ps_shards": 0} if mode == "gossip" else {}))
    assert old_path_reason(exp, local_ranks=2) == ""
    assert builtin_train_function(exp, local_ranks=2).train == BUILTIN_TRAIN


def test_a_node_sharding_its_model_over_its_local_ranks_keeps_the_old_trainer() -> None:
    exp = Experiment(**DIGITS, mode="async", parallelism="pipeline")
    assert "pipeline" in old_path_reason(exp, local_ranks=2) and "2 local ranks" in old_path_reason(exp, local_ranks=2)
    assert builtin_train_function(exp, local_ranks=2) is exp


def test_a_users_train_function_is_left_as_it_is() -> None:
    exp = Experiment(name="u", train="tests.integration._user_loop:train", mode="sync")
    assert old_path_reason(exp) == "" and builtin_train_function(exp) is exp


def test_a_users_train_function_still_may_not_name_a_model() -> None:
    with pytest.raises(ConfigError) as e:
        Experiment(name="u", train="tests.integration._user_loop:train", model="gossamer.examples.digits:mlp")
    assert e.value.field == "model"


def test_the_builtin_train_function_needs_the_model_and_dataset_it_reads() -> None:
    with pytest.raises(ConfigError) as e:
        Experiment(name="b", train=BUILTIN_TRAIN, mode="sync")
    assert e.value.field == "model"


@pytest.mark.parametrize("row", rows(), ids=lambda m: m.label)
def test_every_mode_names_its_unit_which_lives_in_the_modes_own_folder(row: Mode) -> None:
    from gossamer.training.gossip.gossip_function import GossipFunctionTrainer
    from gossamer.training.shards.shard_function import ShardFunctionTrainer

    unit = resolve(row.function_trainer)
    assert issubclass(unit, ShardFunctionTrainer if row.servers else GossipFunctionTrainer), row.function_trainer
    folder = unit.__module__.split(".")[2]  # gossamer.training.<folder>.<module>
    # diloco's gossip outer step is gossip's unit (it averages by push-sum); every other row is its mode's own
    assert folder == ("gossip" if row.gossips else {"async": "asynchronous"}.get(row.name, row.name)), unit.__module__


@pytest.mark.parametrize(("fields", "unit"), [
    ({"mode": "sync"}, "SyncFunctionTrainer"),
    ({"mode": "async"}, "AsyncFunctionTrainer"),
    ({"mode": "diloco"}, "DilocoFunctionTrainer"),
    ({"mode": "diloco", "outer_step": "async"}, "DilocoFunctionTrainer"),
    ({"mode": "gossip", "num_ps_shards": 0}, "GossipFunctionTrainer"),
    ({"mode": "diloco", "outer_step": "gossip", "num_ps_shards": 0}, "GossipFunctionTrainer"),
])
def test_a_users_train_function_runs_over_its_modes_unit(fields: dict[str, object], unit: str) -> None:
    from gossamer.training.train_function import function_trainer

    assert function_trainer(Experiment(name="t", train="tests.integration._user_loop:train", **fields)).__name__ == unit


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_builtin_loop_in_async_and_sync_pushes_its_gradient(mode: str) -> None:
    from gossamer.training.train_function import function_trainer

    exp = builtin_train_function(Experiment(name="t", model="gossamer.examples.digits:mlp",
                                            dataset="gossamer.examples.digits:data", mode=mode))
    assert function_trainer(exp).__name__ == "GradientPushTrainer"
