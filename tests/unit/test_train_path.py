"""Which experiments run through a train function: `old_path_reason` names what keeps one on the mode trainers."""

from __future__ import annotations

from typing import Any

import pytest

from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment
from gossamer.core.train_path import BUILTIN_TRAIN, builtin_train_function, old_path_reason

DIGITS: dict[str, Any] = {"name": "d", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data"}


def test_a_builtin_gossip_experiment_runs_as_the_builtin_train_function_with_its_fields_kept() -> None:
    exp = Experiment(**DIGITS, mode="gossip", num_ps_shards=0, lr=0.1, momentum=0.9)
    assert old_path_reason(exp) == ""
    routed = builtin_train_function(exp)
    assert routed.train == BUILTIN_TRAIN
    assert (routed.model, routed.dataset, routed.lr, routed.momentum) == (exp.model, exp.dataset, 0.1, 0.9)
    assert Experiment.from_json(routed.to_json()) == routed  # it travels to the roles as it is


@pytest.mark.parametrize(("fields", "said"), [
    ({"mode": "async"}, "async"),
    ({"mode": "sync"}, "sync"),
    ({"mode": "diloco"}, "diloco"),
    ({"mode": "diloco", "outer_step": "gossip", "num_ps_shards": 0}, "diloco/gossip"),
    ({"mode": "gossip", "num_ps_shards": 0, "precision": "fp16"}, "fp16"),
])
def test_what_the_train_function_trainers_do_otherwise_keeps_the_old_path_and_says_why(
        fields: dict[str, Any], said: str) -> None:
    exp = Experiment(**DIGITS, **fields)
    assert said in old_path_reason(exp)
    assert builtin_train_function(exp) is exp


def test_a_node_of_several_local_ranks_keeps_the_old_gossip_trainer() -> None:
    exp = Experiment(**DIGITS, mode="gossip", num_ps_shards=0)
    assert "2 local ranks" in old_path_reason(exp, local_ranks=2)
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
