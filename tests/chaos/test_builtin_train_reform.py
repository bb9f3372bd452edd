"""gossamer's own train function in sync: a worker killed mid-run re-forms the barrier, and the step is computed
again over the survivors, so the run still ends where one process ends on the same global batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gossamer import Client, Experiment, Result, load_checkpoint
from gossamer.core.experiment import BUILTIN_TRAIN
from gossamer.engine.model import build
from gossamer.paramserver import flatten_params
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import MakeCluster, ranks_env
from tests.chaos._wait import assert_running, wait_for, wait_steps
from tests.integration._ps_harness import reference_sync

pytestmark = pytest.mark.timeout(420)


def _run_killing_w1(cluster: LocalCluster, client: Client, spec: dict[str, Any]) -> tuple[Result, list[dict[str, Any]], str]:
    """`spec` run until 100 steps, node w1 killed there (mid-step, surely: the survivors wait on its contribution),
    then to its end: completed, with w1 counted lost; its result, events and their text."""
    job = client.submit(spec)
    wait_steps(job, 100, 180, "100 steps")
    cluster.kill_node("w1")
    assert_running(job, "the kill of w1")
    result = job.wait(timeout=300)
    events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert any(e["kind"] == "lost" and "node w1 " in e["message"] for e in events), text
    return result, events, text


def test_a_killed_worker_makes_the_builtin_train_function_compute_the_step_again_over_the_survivors(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    spec = {
        "name": "builtin-reform", "train": BUILTIN_TRAIN, "model": "gossamer.examples.digits:mlp",
        "dataset": "gossamer.examples.digits:data", "mode": "sync", "lr": 0.1, "momentum": 0.9,
        "global_batch_size": 96, "num_ps_shards": 1, "ps_backup": False, "min_workers": 2, "max_workers": 3,
        "total_steps": 400, "eval_every": 0,
    }
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        slow = {"GOSSAMER_FAULT": "delay:seconds=0.03"}  # lets the kill land mid-run
        for name in ("w0", "w1", "w2"):
            cluster.add_node(name, spot=True, env=slow)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 4, 60, "nodes")
        result, events, text = _run_killing_w1(cluster, client, spec)
    assert not any(e["kind"] == "reassign" and "joins as worker" in e["message"] for e in events), text
    assert result.metrics["redone_steps"] >= 1  # the step the kill interrupted was computed again
    exp = Experiment.from_dict(spec)
    model, _, _ = build(exp, torch.device("cpu"))
    model.load_state_dict(load_checkpoint(result.checkpoint))
    ours, ref = flatten_params(model), reference_sync(exp, 96)
    # Up to the order of float sums (the survivors split each global batch in two, not three).
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-3), float((ours - ref).abs().max())


def test_nodes_of_two_local_ranks_send_their_step_again_when_a_killed_worker_re_forms_the_barrier(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    """The survivors are nodes of two local ranks whose ranks push their own chunks to two shards: a rank refused
    by the re-formed barrier sends the same gradient again (its node's other rank may have been answered, or wait
    on its part), and the run completes with every rank in step."""
    spec = {
        "name": "builtin-reform-ranks", "train": BUILTIN_TRAIN, "model": "gossamer.examples.digits:mlp",
        "dataset": "gossamer.examples.digits:data", "mode": "sync", "lr": 0.1, "momentum": 0.9,
        "global_batch_size": 96, "num_ps_shards": 2, "ps_backup": False, "chunk_numel": 512, "min_workers": 2,
        "max_workers": 3, "total_steps": 400, "eval_every": 0,
    }
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        for name in ("ps0", "ps1"):
            cluster.add_node(name)
        wait_for(lambda: len(client.nodes()) == 2, 60, "ps")
        slow = {"GOSSAMER_FAULT": "delay:seconds=0.03"}  # lets the kill land mid-run
        cluster.add_node("w0", spot=True, nproc_per_node=2, env=slow | ranks_env(2))
        cluster.add_node("w1", spot=True, env=slow)
        cluster.add_node("w2", spot=True, nproc_per_node=2, env=slow | ranks_env(2))
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 5, 90, "nodes")
        result, _, _ = _run_killing_w1(cluster, client, spec)
    assert result.metrics["redone_steps"] >= 1, result.metrics  # a rank's push was refused and sent again
    assert result.metrics["eval_accuracy"] > 0.9, result.metrics
    model, _, _ = build(Experiment.from_dict(spec), torch.device("cpu"))
    model.load_state_dict(load_checkpoint(result.checkpoint))  # one model: the nodes' ranks ended in step
