"""A user's train function on nodes of two local ranks (`worker join --nproc-per-node 2`, gloo): every process runs
it, each backward pass ends with the node's mean gradient, and the node's ranks step alike."""

from __future__ import annotations

from collections import defaultdict

import pytest

import gossamer
from gossamer.examples.digits import mlp
from gossamer.tools.local_cluster import LocalCluster
from tests.integration._cli_cluster import ranks_cluster
from tests.integration._plain_equal import assert_sync_runs_equal_plain

pytestmark = pytest.mark.timeout(420)

U = "tests.integration._user_loop"
SYNC = {"num_ps_shards": 1, "ps_backup": False, "global_batch_size": 16}
MODE_FIELDS: dict[str, dict[str, object]] = {
    "async": {"num_ps_shards": 1, "ps_backup": False},
    "diloco": {"num_ps_shards": 1, "ps_backup": False, "inner_steps": 10},
    "gossip": {"num_ps_shards": 0},
}


def _final_points(job: gossamer.Job, processes: int) -> list[dict[str, float]]:
    """Each process's closing report (`_user_loop.train_reporting_ranks`): one per process of the run."""
    points = [p for p in job.metrics() if "checksum" in p]
    assert len({p["source"] for p in points}) == processes, points
    assert sorted(int(p["rank"]) for p in points) == list(range(processes)), points
    assert {(p["world_size"], p["local_world_size"]) for p in points} == {(processes, 2)}, points
    return points


@pytest.mark.parametrize("no_sync", [False, True])
def test_sync_on_nodes_of_two_local_ranks_ends_with_one_plain_process_parameters(cluster: LocalCluster,
                                                                                  no_sync: bool) -> None:
    # AdamW (0.9, 0.95), a warm-up, accumulation 2 (each backward exchanged, or the first inside no_sync) and
    # clipping, over 1 node of 2 ranks and 2 nodes of 2: every process steps on the mean gradient of the same 16
    # samples a plain process trains on, so all of them end with its parameters.
    total = 40
    client = ranks_cluster(cluster, 2, {"USER_LOOP_NO_SYNC": "1" if no_sync else "0"})
    states = []
    for workers in (1, 2):
        job = client.submit({"name": f"sync-{workers}x2", "train": f"{U}:train_reporting_ranks", "mode": "sync",
                             "total_steps": total, "min_workers": workers, "max_workers": workers, **SYNC})
        result = job.wait(timeout=300)
        assert result.status == "completed", result.message
        states.append(gossamer.load_checkpoint(result.checkpoint))
        points = _final_points(job, 2 * workers)
        assert len({p["checksum"] for p in points}) == 1, points  # every process took the same steps
    client.close()
    assert_sync_runs_equal_plain(dict(zip(("1x2", "2x2"), states, strict=True)), f"{U}:train", total, SYNC)


@pytest.mark.parametrize("mode", ["async", "diloco", "gossip"])
def test_a_users_loop_on_nodes_of_two_local_ranks_learns_digits_and_each_nodes_ranks_step_alike(
        cluster: LocalCluster, mode: str) -> None:
    client = ranks_cluster(cluster, 2, {})
    job = client.submit({"name": f"ranks-{mode}", "train": f"{U}:train_reporting_ranks", "mode": mode,
                         "total_steps": 300, "min_workers": 2, "max_workers": 2, **MODE_FIELDS[mode]})
    result = job.wait(timeout=360)
    assert result.status == "completed", result.message
    points = _final_points(job, 4)
    accuracy = [p["eval_accuracy"] for p in job.metrics() if "eval_accuracy" in p]
    assert accuracy and min(accuracy) > 0.9, accuracy  # every process of the lead node evaluated its model
    by_node: dict[int, set[float]] = defaultdict(set)
    for p in points:
        by_node[int(p["rank"]) // 2].add(p["checksum"])
    assert len(by_node) == 2 and all(len(sums) == 1 for sums in by_node.values()), points
    state = gossamer.load_checkpoint(result.checkpoint)
    mlp(hidden=64).load_state_dict(state)  # the user's own key names
    client.close()


def test_a_step_whose_backward_was_inside_no_sync_on_two_local_ranks_fails_the_run_naming_no_sync(
        cluster: LocalCluster) -> None:
    # In async the ranks' gradients are averaged by backward alone: stepping on each rank's own would take the
    # node's ranks apart.
    client = ranks_cluster(cluster, 1, {})
    job = client.submit({"name": "ranks-no-sync", "train": f"{U}:steps_inside_no_sync", "mode": "async",
                         "total_steps": 300, **MODE_FIELDS["async"]})
    result = job.wait(timeout=120)
    client.close()
    assert result.status == "failed", result
    assert "ctx.no_sync()" in result.message and "local ranks" in result.message, result.message


def test_a_parameter_with_a_gradient_on_one_local_rank_only_is_stepped_on_every_rank(cluster: LocalCluster) -> None:
    client = ranks_cluster(cluster, 1, {})
    # sync: nothing but the steps keeps the ranks' parameters alike (async writes the shards' values into both)
    job = client.submit({"name": "ranks-unused", "train": f"{U}:train_one_rank_touches_a_parameter", "mode": "sync",
                         "total_steps": 20, **MODE_FIELDS["async"]})
    result = job.wait(timeout=120)
    points = [p for p in job.metrics() if "extra" in p]
    client.close()
    assert result.status == "completed", result.message
    assert sorted(p["local_rank"] for p in points) == [0.0, 1.0], points
    extra = {p["extra"] for p in points}
    assert len(extra) == 1 and extra.pop() < 4.0, points  # decayed alike on both ranks


def test_a_hugging_face_trainer_on_a_node_of_two_local_ranks_trains_and_its_ranks_step_alike(
        cluster: LocalCluster) -> None:
    # transformers.Trainer in each process of the node, on the prepared model and optimizer. It finds no launcher's
    # environment (gossamer's group is formed over tcp://), so it runs NOT_PARALLEL without a DDP wrapper of its
    # own, and each backward's node mean keeps the two ranks on the same parameters.
    pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
    pytest.importorskip("accelerate", reason="the [hf] extra (accelerate, for transformers.Trainer) is not installed")
    client = ranks_cluster(cluster, 1)
    job = client.submit({"name": "hf-ranks", "train": "gossamer.examples.hf_trainer:train", "mode": "diloco",
                         "inner_steps": 10, "num_ps_shards": 1, "ps_backup": False, "total_steps": 60,
                         "min_workers": 1, "max_workers": 1})
    result = job.wait(timeout=360)
    assert result.status == "completed", result.message
    points = job.metrics()
    losses = [p["loss"] for p in points if "loss" in p]
    evals = [p["eval_loss"] for p in points if "eval_loss" in p]
    assert losses and evals and evals[-1] < 4.5, (losses[:3], evals)  # from about ln 256 = 5.5 nats a byte
    assert len({p["source"] for p in points if "loss" in p}) == 2  # both processes ran the Trainer
    state = gossamer.load_checkpoint(result.checkpoint)
    assert any(k.startswith("transformer.") for k in state)
    client.close()
