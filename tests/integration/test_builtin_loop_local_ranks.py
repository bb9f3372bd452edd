"""gossamer's built-in loop on nodes of two local ranks runs as its train function: `batch_size` stays the node's,
each rank takes its share of the node's samples, and the node's mean gradient is the node batch's."""

from __future__ import annotations

import pytest

import gossamer
from gossamer import Experiment
from gossamer.checkpoint.manifest import read_manifest
from gossamer.core.experiment import BUILTIN_TRAIN
from gossamer.engine.shard_plan import flatten_params
from gossamer.examples.digits import mlp
from gossamer.tools.local_cluster import LocalCluster
from tests.integration._cli_cluster import ranks_cluster
from tests.integration._ps_harness import reference_sync

pytestmark = pytest.mark.timeout(420)

DIGITS: dict[str, object] = {"model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
                             "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "eval_every": 0}
# Chunks of 512 over two shards: each rank pushes its own chunks, to both shards.
SHARDS: dict[str, object] = {"num_ps_shards": 2, "ps_backup": False, "chunk_numel": 512}


def test_builtin_sync_on_nodes_of_two_local_ranks_ends_with_one_plain_process_parameters(
        cluster: LocalCluster) -> None:
    # One node of 2 ranks, then two: each rank backprops its quarter or half of the worker's share of the same
    # global batch of 32, and the shards step SGD with momentum on the workers' sum, as one process does.
    total = 40
    client = ranks_cluster(cluster, 2, shard_nodes=2)
    for workers in (1, 2):
        spec = {"name": f"builtin-sync-{workers}x2", **DIGITS, **SHARDS, "mode": "sync", "global_batch_size": 32,
                "total_steps": total, "min_workers": workers, "max_workers": workers}
        result = client.submit(spec).wait(timeout=300)
        assert result.status == "completed", result.message
        assert read_manifest(result.checkpoint)["experiment"]["train"] == BUILTIN_TRAIN  # it took the one path
        model = mlp()
        model.load_state_dict(gossamer.load_checkpoint(result.checkpoint))
        want = reference_sync(Experiment.from_dict(spec), global_batch=32)
        gap = (flatten_params(model) - want).abs().max().item()
        assert gap <= 1e-5, (workers, gap)
        assert (flatten_params(model) - flatten_params(mlp())).abs().max().item() > 1e-2  # it trained
    client.close()


@pytest.mark.parametrize("mode", ["async", "gossip"])
def test_builtin_async_and_gossip_on_nodes_of_two_local_ranks_learn_digits(cluster: LocalCluster, mode: str) -> None:
    client = ranks_cluster(cluster, 2, shard_nodes=2)
    fields = {"num_ps_shards": 0} if mode == "gossip" else SHARDS
    job = client.submit({"name": f"builtin-{mode}-2x2", **DIGITS, **fields, "mode": mode, "batch_size": 32,
                         "total_steps": 400, "min_workers": 2, "max_workers": 2, "momentum": 0.5})
    result = job.wait(timeout=360)
    assert result.status == "completed", result.message
    assert read_manifest(result.checkpoint)["experiment"]["train"] == BUILTIN_TRAIN
    assert result.metrics["eval_accuracy"] > 0.9, result.metrics
    # Both ranks of each node exchanged their own chunks (async) or the node's rank 0 mixed (gossip).
    sources = {p["source"] for p in job.metrics() if "samples" in p}
    assert len(sources) == 2, sources  # one figure of samples per node: its local rank 0's
    samples = max(p["samples"] for p in job.metrics() if "samples" in p)
    assert samples >= 0.9 * 32 * 400 / 2, samples  # a node's samples, not one rank's share of them
    mlp().load_state_dict(gossamer.load_checkpoint(result.checkpoint))
    client.close()
