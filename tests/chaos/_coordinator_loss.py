"""What the coordinator-loss tests share: an async digits run on three nodes, and the shard's version as a bystander reads it."""

from __future__ import annotations

from gossamer import Client
from gossamer.examples.digits import mlp
from gossamer.paramserver import ShardClient, ShardPlan
from gossamer.tools.client import Job
from gossamer.tools.local_cluster import LocalCluster
from tests.chaos._wait import wait_for


def start_digits_run(cluster: LocalCluster, client: Client, name: str, total_steps: int = 4000) -> Job:
    """Nodes "ps" (joined first: it hosts the one shard), "w0" and "w1" (spot workers); an async
    digits run of `total_steps` on them, submitted once all three are ready."""
    cluster.add_node("ps")
    wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
    cluster.add_node("w0", spot=True)
    cluster.add_node("w1", spot=True)
    wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 3, 60, "three nodes")
    return client.submit({
        "name": name, "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "min_workers": 2, "max_workers": 2,
        "total_steps": total_steps, "eval_every": 200,
    })


def shard_version(exp_id: str, endpoint: str) -> int:
    """The version of the run's one shard at `endpoint` (updates applied)."""
    client = ShardClient(experiment=exp_id, sender="observer", plan=ShardPlan.for_module(mlp(), 1),
                         endpoints={0: endpoint}, timeout_s=10)
    try:
        return int(client.stats(0)["version"])
    finally:
        client.close()
