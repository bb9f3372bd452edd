"""A user's own loop (`Experiment(train=...)`) through a CLI cluster: it learns, checkpoints, survives a lost worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import gossamer
from gossamer import Client
from gossamer.core.experiment import Experiment
from gossamer.examples.digits import mlp
from gossamer.tools.local_cluster import LocalCluster
from gossamer.training.train_function import capture_model
from tests._fixtures import write_toml
from tests.integration._cli_cluster import cli, spot_cluster
from tests.integration._plain_equal import assert_sync_runs_equal_plain

pytestmark = pytest.mark.timeout(420)

U = "tests.integration._user_loop"










def _evals(client: Client, exp_id: str) -> list[float]:
    return [p["eval_accuracy"] for p in client.job(exp_id).metrics() if "eval_accuracy" in p]


MODE_FIELDS: dict[str, dict[str, object]] = {
    # The user's loop asks ctx.data for batches of 16: in sync each of the workers gets its share of those 16.
    "sync": {"num_ps_shards": 1, "ps_backup": False, "global_batch_size": 16},
    "async": {"num_ps_shards": 1, "ps_backup": False},
    # async with overlap: each change leaves while the next step is computed
    "async-overlap": {"num_ps_shards": 1, "ps_backup": False, "overlap": True},
    "diloco": {"num_ps_shards": 1, "ps_backup": False, "inner_steps": 10},
    "gossip": {"num_ps_shards": 0},
}


@pytest.mark.parametrize("mode", ["sync", "async", "async-overlap", "diloco", "gossip"])
def test_a_users_adamw_loop_learns_digits_and_checkpoints_its_own_model(cluster: LocalCluster, tmp_path: Path,
                                                                         mode: str) -> None:
    address, client = spot_cluster(cluster, workers=2)
    spec = write_toml(tmp_path / "loop.toml", name=f"loop-{mode}", train=f"{U}:train", mode=mode.split("-")[0],
                      total_steps=300, min_workers=2, max_workers=2, **MODE_FIELDS[mode])
    out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    exp_id = out.stdout.splitlines()[0].strip()
    result = client.job(exp_id).wait(timeout=30)
    assert result.status == "completed", result
    accuracy = _evals(client, exp_id)
    assert accuracy and accuracy[-1] > 0.9, accuracy  # the lead's own evaluation, reported through ctx.report
    losses = [p["loss"] for p in client.job(exp_id).metrics() if "loss" in p]
    assert losses and losses[-1] < losses[0], losses
    state = gossamer.load_checkpoint(result.checkpoint)
    model = mlp(hidden=64)
    model.load_state_dict(state)  # the user's own key names
    assert all(torch.isfinite(v).all() for v in state.values())
    client.close()


def _failed_run_status(cluster: LocalCluster, tmp_path: Path, fn: str, mode: str) -> str:
    """`gossamer status` of a run of `fn` on one worker, which must have failed."""
    address, client = spot_cluster(cluster, workers=1)
    spec = write_toml(tmp_path / f"{fn}.toml", name=fn.replace("_", "-"), train=f"{U}:{fn}", mode=mode,
                      num_ps_shards=1, total_steps=300, ps_backup=False)
    out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
    assert out.returncode != 0
    exp_id = out.stdout.splitlines()[0].strip()
    status = cli("status", exp_id, "-c", address, timeout=60)
    client.close()
    text = status.stdout + status.stderr
    assert "failed" in text and "train" in text, text
    return text


def test_a_train_function_that_raises_fails_the_run_naming_train_and_the_users_line(cluster: LocalCluster,
                                                                                     tmp_path: Path) -> None:
    text = _failed_run_status(cluster, tmp_path, "raises", "async")
    assert "the user's loop broke at step 3" in text and "_user_loop.py" in text, text


def test_a_sync_step_with_every_backward_inside_no_sync_fails_the_run_naming_no_sync(cluster: LocalCluster,
                                                                                      tmp_path: Path) -> None:
    # Its .grad would hold this worker's own gradient: stepping on it would take the workers apart.
    text = _failed_run_status(cluster, tmp_path, "steps_inside_no_sync", "sync")
    assert "ctx.no_sync()" in text, text


def test_an_import_error_in_train_is_refused_at_submit(cluster: LocalCluster, tmp_path: Path) -> None:
    address, client = spot_cluster(cluster, workers=0)
    spec = write_toml(tmp_path / "missing.toml", name="missing", train="tests.integration._no_such_module:train",
                 mode="async", num_ps_shards=1, total_steps=10)
    out = cli("submit", str(spec), "--coordinator", address, "--quiet")
    assert out.returncode == 2, out  # an invalid experiment, refused before anything ran
    assert "train" in out.stderr and "_no_such_module" in out.stderr, out.stderr
    client.close()


@pytest.mark.parametrize("fn", ["train", "train_no_sync"])
def test_sync_users_loop_with_1_and_2_workers_at_one_global_batch_ends_with_one_plain_process_parameters(
        cluster: LocalCluster, tmp_path: Path, fn: str) -> None:
    # AdamW (0.9, 0.95), a LambdaLR warm-up, accumulation 2 (every backward exchanged, or the first in no_sync)
    # and clip_grad_norm_: all see the workers' mean gradient, as one process sees its batch's.
    total = 40
    address, client = spot_cluster(cluster, workers=2)
    states = []
    for workers in (1, 2):
        spec = write_toml(tmp_path / f"sync{workers}.toml", name=f"sync-{workers}", train=f"{U}:{fn}", mode="sync",
                          total_steps=total, min_workers=workers, max_workers=workers, **MODE_FIELDS["sync"])
        out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
        assert out.returncode == 0, out.stdout + out.stderr
        result = client.job(out.stdout.splitlines()[0].strip()).wait(timeout=30)
        assert result.status == "completed", result
        states.append(gossamer.load_checkpoint(result.checkpoint))
    client.close()
    assert_sync_runs_equal_plain(dict(zip(("1", "2"), states, strict=True)), f"{U}:{fn}", total, MODE_FIELDS["sync"])


@pytest.mark.parametrize("mode", ["async", "async-overlap"])
def test_async_with_one_worker_ends_with_one_plain_process_parameters(cluster: LocalCluster, tmp_path: Path,
                                                                     mode: str) -> None:
    # The shards add each change the user's optimizer made; with overlap the reply to the previous push, less
    # the change made since, becomes the parameters: alone, a worker's run is the plain one, change for change.
    total = 60
    address, client = spot_cluster(cluster, workers=1)
    spec = write_toml(tmp_path / "one.toml", name=f"one-{mode}", train=f"{U}:train", mode="async", total_steps=total,
                      min_workers=1, max_workers=1, **MODE_FIELDS[mode])
    out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    result = client.job(out.stdout.splitlines()[0].strip()).wait(timeout=30)
    client.close()
    assert result.status == "completed", result
    state = gossamer.load_checkpoint(result.checkpoint)
    plain = gossamer.run_local(Experiment(name="plain", train=f"{U}:train", mode="async", total_steps=total))
    gap = max((state[k] - plain[k]).abs().max().item() for k in plain)
    assert gap <= 1e-5, gap
    assert max((plain[k] - mlp(hidden=64).state_dict()[k]).abs().max().item() for k in plain) > 1e-2  # it trained


def test_diloco_takes_the_outer_step_on_the_workers_mean_change(cluster: LocalCluster, tmp_path: Path) -> None:
    # Every worker's change over a round is 5 x 0.01 on every value; with plain outer SGD at lr 1 a round
    # moves the run by their mean, 0.05, with 1 worker or 2 (their sum would move it by 0.1 with 2).
    total, rounds = 20, 4
    address, client = spot_cluster(cluster, workers=2)
    moved: dict[int, dict[str, torch.Tensor]] = {}
    for workers in (1, 2):
        spec = write_toml(tmp_path / f"drift{workers}.toml", name=f"drift-{workers}", train=f"{U}:drift",
                          mode="diloco", total_steps=total, min_workers=workers, max_workers=workers,
                          num_ps_shards=1, ps_backup=False, inner_steps=total // rounds, outer_lr=1.0,
                          outer_momentum=0.0)
        out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
        assert out.returncode == 0, out.stdout + out.stderr
        result = client.job(out.stdout.splitlines()[0].strip()).wait(timeout=30)
        assert result.status == "completed", result
        state = gossamer.load_checkpoint(result.checkpoint)
        init = capture_model(Experiment(name="init", train=f"{U}:drift", mode="diloco")).state_dict()
        moved[workers] = state
    client.close()
    # fp32 round-off of 20 steps and 4 outer steps on values near 1: a few 1e-5 (their sum would be 0.2 off)
    off = {w: max((init[k] - s[k] - rounds * 0.05).abs().max().item() for k in s) for w, s in moved.items()}
    assert all(gap <= 1e-4 for gap in off.values()), off
    assert max((moved[1][k] - moved[2][k]).abs().max().item() for k in init) <= 1e-6, off


def _progress(client: Client, exp_id: str) -> int:
    return int(client.job(exp_id).status()["steps"])


def _await_progress(client: Client, exp_id: str, step: int, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while (now := _progress(client, exp_id)) < step:
        assert client.job(exp_id).status()["state"] in ("queued", "starting", "running"), client.job(exp_id).status()
        assert time.monotonic() < deadline, f"step {now} of {step}"
        time.sleep(0.2)
    return now


@pytest.mark.parametrize("mode", ["sync", "async", "diloco", "gossip"])
def test_a_killed_worker_costs_the_run_nothing_and_a_joining_one_starts_from_the_runs_state(
        cluster: LocalCluster, tmp_path: Path, mode: str) -> None:
    total = 4000
    # The workers that started the run wait at half of it until the test has seen the joiner train: the joiner
    # trains before the end, however fast the run.
    release = tmp_path / "joiner-trained"
    hold = {"USER_LOOP_HOLD_FROM": str(total // 2), "USER_LOOP_RELEASE_FILE": str(release)}
    address, client = spot_cluster(cluster, workers=2, env=hold)
    spec = write_toml(tmp_path / "loop.toml", name=f"elastic-{mode}", train=f"{U}:train", mode=mode, total_steps=total,
                 min_workers=1, max_workers=2, **MODE_FIELDS[mode])
    out = cli("submit", str(spec), "--coordinator", address, "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    exp_id = out.stdout.splitlines()[0].strip()
    cluster.add_node("spot2", spot=True, env=hold)  # a free node for the lost worker's place
    cluster.wait_joined("spot2", timeout=60)
    killed_at = _await_progress(client, exp_id, total // 4)
    cluster.kill_node("spot1")
    assert killed_at < total and client.job(exp_id).status()["state"] == "running"  # it landed mid-run

    def first_loss_by_source() -> dict[str, tuple[int, float]]:
        first: dict[str, tuple[int, float]] = {}
        for p in client.job(exp_id).metrics():
            if "loss" in p:
                first.setdefault(p["source"], (int(p["step"]), float(p["loss"])))
        return first

    # The joiner is the worker whose losses come from a source new since the kill. Its first step is at least the
    # kill's: in diloco one let into the round the kill interrupted starts at that round's step, the kill's own.
    before = set(first_loss_by_source())
    deadline = time.monotonic() + 120
    while not (joiners := {s: v for s, v in first_loss_by_source().items() if s not in before}):
        assert client.job(exp_id).status()["state"] == "running", "the run ended before a joining worker trained"
        assert time.monotonic() < deadline, (killed_at, first_loss_by_source())
        time.sleep(0.2)
    assert all(step >= killed_at for step, _ in joiners.values()), (killed_at, joiners)
    release.touch()
    result = client.job(exp_id).wait(timeout=300)
    assert result.status == "completed", result
    first = sorted(first_loss_by_source().values())[0]
    # The joiner started from the run's parameters (the run's first losses are near ln 10 = 2.3).
    assert first[1] > 1.5 and all(loss < 1.0 for _, loss in joiners.values()), (first, joiners)
    assert _evals(client, exp_id)[-1] > 0.9
    client.close()


@pytest.mark.parametrize("mode", ["async", "diloco"])
def test_a_hugging_face_trainer_trains_a_gpt2_from_a_config_inside_a_train_function(
        cluster: LocalCluster, tmp_path: Path, mode: str) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
    pytest.importorskip("accelerate", reason="the [hf] extra (accelerate, for transformers.Trainer) is not installed")
    address, client = spot_cluster(cluster, workers=2)
    extra = {"inner_steps": 10} if mode == "diloco" else {}
    spec = write_toml(tmp_path / "hf.toml", name=f"hf-{mode}", train="gossamer.examples.hf_trainer:train", mode=mode,
                 num_ps_shards=1, total_steps=100, ps_backup=False, min_workers=2, **extra)
    out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    exp_id = out.stdout.splitlines()[0].strip()
    result = client.job(exp_id).wait(timeout=30)
    assert result.status == "completed", result
    points = client.job(exp_id).metrics()
    losses = [p["loss"] for p in points if "loss" in p]
    evals = [p["eval_loss"] for p in points if "eval_loss" in p]
    # From about ln 256 = 5.5 nats a byte at the start to well under it: the Trainer's steps reached the run.
    assert losses and evals and evals[-1] < 4.0, (losses[:3], evals)
    assert {"learning_rate", "grad_norm"} <= {k for p in points for k in p}
    state = gossamer.load_checkpoint(result.checkpoint)
    assert any(k.startswith("transformer.") for k in state)  # the Hugging Face model's own key names
    client.close()
