"""gossamer's built-in loop (`model`/`dataset`/...) is a train function of its own: one path for it and the user's."""

from __future__ import annotations

from pathlib import Path

import pytest

import gossamer
from gossamer.checkpoint.manifest import read_manifest
from gossamer.core.experiment import BUILTIN_TRAIN, Experiment
from gossamer.engine.shard_plan import flatten_params
from gossamer.examples.digits import mlp
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import write_toml
from tests.integration._cli_cluster import cli, spot_cluster
from tests.integration._ps_harness import reference_sync, run_async

pytestmark = pytest.mark.timeout(300)

ONE_WORKER: dict[str, object] = {"total_steps": 40, "min_workers": 1, "max_workers": 1, "eval_every": 0}
#: Sync on one shard at a global batch of 32: the built-in digits experiment and the user's loop alike.
SYNC: dict[str, object] = {"mode": "sync", "global_batch_size": 32, "num_ps_shards": 1, "ps_backup": False,
                           **ONE_WORKER}
GOSSIP: dict[str, object] = {"mode": "gossip", "num_ps_shards": 0, "batch_size": 32, **ONE_WORKER}
ASYNC: dict[str, object] = {"mode": "async", "num_ps_shards": 1, "ps_backup": False, "batch_size": 32, **ONE_WORKER}
DIGITS: dict[str, object] = {"model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
                             "optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
USER = "tests.integration._user_loop:builtin_equivalent"


def _run(address: str, client: gossamer.Client, spec: Path) -> gossamer.Result:
    out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    result = client.job(out.stdout.splitlines()[0].strip()).wait(timeout=30)
    assert result.status == "completed", result
    return result


def _gap(a: dict[str, object], b: dict[str, object]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)  # type: ignore[operator]


def test_the_builtin_train_function_in_sync_ends_with_the_users_loop_and_one_process_parameters(
        cluster: LocalCluster, tmp_path: Path) -> None:
    address, client = spot_cluster(cluster, workers=1)
    builtin = _run(address, client, write_toml(tmp_path / "builtin.toml", name="builtin", train=BUILTIN_TRAIN,
                                               **DIGITS, **SYNC))
    user = _run(address, client, write_toml(tmp_path / "user.toml", name="user", train=USER, **SYNC))
    client.close()
    got = gossamer.load_checkpoint(builtin.checkpoint)
    assert _gap(got, gossamer.load_checkpoint(user.checkpoint)) <= 1e-5
    model = mlp()
    model.load_state_dict(got)
    want = reference_sync(Experiment(name="plain", **DIGITS, **SYNC), global_batch=32)  # type: ignore[arg-type]
    assert (flatten_params(model) - want).abs().max().item() <= 1e-5
    assert _gap(got, mlp().state_dict()) > 1e-2  # it trained
    assert builtin.metrics["eval_accuracy"] > 0.5  # gossamer's own evaluation, through ctx.evaluate_with


def test_a_builtin_gossip_experiment_runs_as_the_builtin_train_function_and_ends_with_the_users_loop_parameters(
        cluster: LocalCluster, tmp_path: Path) -> None:
    address, client = spot_cluster(cluster, workers=1)
    builtin = _run(address, client, write_toml(tmp_path / "builtin.toml", name="builtin", **DIGITS, **GOSSIP))
    user = _run(address, client, write_toml(tmp_path / "user.toml", name="user", train=USER, **GOSSIP))
    client.close()
    assert read_manifest(builtin.checkpoint)["experiment"]["train"] == BUILTIN_TRAIN  # it took the one path
    got = gossamer.load_checkpoint(builtin.checkpoint)
    assert _gap(got, gossamer.load_checkpoint(user.checkpoint)) <= 1e-5
    assert _gap(got, mlp().state_dict()) > 1e-2
    assert builtin.metrics["steps"] == 40 and builtin.metrics["eval_accuracy"] > 0.5


def test_a_builtin_async_experiment_runs_as_the_builtin_train_function_and_ends_where_the_older_trainer_does(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """The built-in async pushes gradients and the shards step the experiment's optimizer (SGD, momentum 0.9) on
    them: one worker's run through the train function ends with the older trainer's parameters on such shards."""
    address, client = spot_cluster(cluster, workers=1)
    builtin = _run(address, client, write_toml(tmp_path / "builtin.toml", name="builtin", **DIGITS, **ASYNC))
    client.close()
    assert read_manifest(builtin.checkpoint)["experiment"]["train"] == BUILTIN_TRAIN  # it took the one path
    model = mlp()
    model.load_state_dict(gossamer.load_checkpoint(builtin.checkpoint))
    old = run_async(Experiment(name="old", **DIGITS, **ASYNC), workers=1)  # type: ignore[arg-type]
    want = flatten_params(old["trainers"][0].model)  # type: ignore[index]
    assert (flatten_params(model) - want).abs().max().item() <= 1e-6
    assert (flatten_params(model) - flatten_params(mlp())).abs().max().item() > 1e-2  # it trained
    assert builtin.metrics["steps"] == 40 and builtin.metrics["eval_accuracy"] > 0.5
