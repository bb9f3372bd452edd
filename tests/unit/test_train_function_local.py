"""A train function run in one process (`gossamer.run_local`): bad use of the context is named, in the user's terms."""

from __future__ import annotations

import pytest
import torch

import gossamer
from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment

U = "tests.integration._user_loop"


def _exp(fn: str, **kw: object) -> Experiment:
    return Experiment(name="local", train=f"{U}:{fn}", total_steps=20, **kw)  # type: ignore[arg-type]


def test_run_local_runs_the_users_loop_to_total_steps_and_returns_its_state() -> None:
    state = gossamer.run_local(_exp("train"))
    model = __import__("gossamer.examples.digits", fromlist=["mlp"]).mlp(hidden=64)
    model.load_state_dict(state)
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.parametrize(("fn", "says"), [
    ("raises", "ValueError: the user's loop broke at step 3 (at _user_loop.py:"),
    ("steps_its_own_optimizer", "stepped directly"),
    ("reshapes", "changed shape"),
])
def test_misuse_fails_naming_train_and_what_went_wrong(fn: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        gossamer.run_local(_exp(fn))
    assert e.value.field == "train" and says in str(e.value), str(e.value)


def test_a_train_function_with_model_or_a_lossy_sync_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="^model: "):
        Experiment(name="x", train=f"{U}:train", model="gossamer.examples.digits:mlp")
    with pytest.raises(ConfigError, match="^compression: .*exact gradients"):
        Experiment(name="x", train=f"{U}:train", mode="sync", compression="int8")
    with pytest.raises(ConfigError, match="^train: must look like"):
        Experiment(name="x", train="not a path")
    with pytest.raises(ConfigError, match="^model: is required"):
        Experiment.from_dict({"name": "x", "dataset": "a:b"})


def test_sync_data_gives_each_batch_the_global_batch_and_refuses_another_batch_size() -> None:
    state = gossamer.run_local(_exp("train", mode="sync", global_batch_size=16))
    assert all(torch.isfinite(v).all() for v in state.values())
    with pytest.raises(ConfigError) as e:
        gossamer.run_local(_exp("train", mode="sync", global_batch_size=32))  # the loop asks for batch_size=16
    assert e.value.field == "batch_size" and "global_batch_size 32" in str(e.value), str(e.value)
