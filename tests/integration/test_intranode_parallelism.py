"""FSDP and pipeline inside a node, async across nodes: real coordinator, node agents and gloo groups."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from gossamer import Client, load_checkpoint
from gossamer.engine.model import evaluate
from gossamer.examples.digits import data, mlp
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import ranks_env

pytestmark = pytest.mark.timeout(600)


def _wait_ready(client: Client, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(x["state"] == "ready" for x in client.nodes()) < n:
        assert time.monotonic() < deadline, client.nodes()
        time.sleep(0.2)


@pytest.mark.parametrize("parallelism", ["fsdp", "pipeline"])
def test_two_nodes_of_two_local_ranks_train_digits_async(cluster: LocalCluster, tmp_path: Path,
                                                         parallelism: str) -> None:
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.wait_joined("ps")
    for i in range(2):
        cluster.add_node(f"w{i}", spot=True, nproc_per_node=2, env=ranks_env(2))
    client = Client(address)
    _wait_ready(client, 3)
    job = client.submit({
        "name": f"digits-{parallelism}", "model": "gossamer.examples.digits:mlp",
        "dataset": "gossamer.examples.digits:data", "mode": "async", "parallelism": parallelism,
        "pipeline_schedule": "1f1b", "pipeline_microbatches": 4,
        "lr": 0.1, "lr_schedule": "cosine", "momentum": 0.5, "batch_size": 32, "staleness": 4,
        "num_ps_shards": 1, "min_workers": 2, "max_workers": 2, "total_steps": 1000, "eval_every": 500,
    })
    result = job.wait(timeout=480)
    assert result.status == "completed", result.message
    assert result.metrics["eval_accuracy"] >= 0.95, result.metrics
    series = job.metrics()
    # Every local rank of both nodes exchanged its own part with the shards.
    sources = {p["source"] for p in series if "bytes_up" in p}
    assert len(sources) == 4, sources
    per_rank_up = [max(p["bytes_up"] for p in series if p.get("source") == s and "bytes_up" in p) for s in sources]
    model_bytes = 4 * sum(p.numel() for p in mlp().parameters())
    steps = result.metrics["steps"]
    # No rank sends the whole model each step: together a node's ranks send it once per step.
    assert max(per_rank_up) < 0.9 * model_bytes * steps / 2 * 1.5, (per_rank_up, model_bytes, steps)
    # The final checkpoint is one piece per rank of the lead node, read back as a plain state_dict.
    ckpt = Path(result.checkpoint)
    assert sorted(p.name for p in ckpt.glob("shard-*")) == ["shard-000", "shard-001"], list(ckpt.iterdir())
    model = mlp()
    model.load_state_dict(load_checkpoint(ckpt))
    acc, _ = evaluate(model, data()[1], torch.device("cpu"))
    assert abs(acc - result.metrics["eval_accuracy"]) < 1e-9
    # Both nodes recorded what they ran on, and the checkpoint carries the lead's fingerprint.
    envs = sorted((ckpt.parent.parent / "environment").glob("*.json"))
    assert [p.stem for p in envs] == ["w0", "w1"], envs
    manifest = json.loads((ckpt / "shard-000" / "manifest.json").read_text())
    assert manifest["extra"]["env"]["torch"] == torch.__version__
    assert manifest["extra"]["parallelism"] == parallelism
    client.close()


@pytest.mark.parametrize("parallelism", ["fsdp", "pipeline"])
def test_sigterm_stops_a_sharded_node_together(cluster: LocalCluster, parallelism: str) -> None:
    """SIGTERM reaches the local ranks at slightly different steps: they agree to stop, none hangs."""
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.wait_joined("ps")
    cluster.add_node("w0", spot=True, nproc_per_node=2, env=ranks_env(2))
    client = Client(address)
    _wait_ready(client, 2)
    job = client.submit({
        "name": "long", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "parallelism": parallelism, "num_ps_shards": 1, "min_workers": 1, "max_workers": 1,
        "total_steps": 10**6, "eval_every": 0,
    })
    deadline = time.monotonic() + 120
    while job.status()["steps"] < 30:
        assert time.monotonic() < deadline, job.status()
        time.sleep(0.2)
    t0 = time.monotonic()
    code = cluster.stop_node("w0", timeout=30)
    elapsed = time.monotonic() - t0
    assert code == 0 and elapsed < 15, (code, elapsed)
    nodes = {n["name"]: n["state"] for n in client.nodes()}
    assert nodes["w0"] == "left", nodes
    client.close()


def test_diloco_with_fsdp_nodes_trains_digits(cluster: LocalCluster) -> None:
    """DiLoCo's inner AdamW steps each rank's own FSDP shard; the pseudo-gradient leaves per rank."""
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.wait_joined("ps")
    for i in range(2):
        cluster.add_node(f"w{i}", spot=True, nproc_per_node=2, env=ranks_env(2))
    client = Client(address)
    _wait_ready(client, 3)
    job = client.submit({
        "name": "diloco-fsdp", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "diloco", "parallelism": "fsdp", "lr": 0.003, "inner_steps": 20, "outer_momentum": 0.6,
        "num_ps_shards": 1, "ps_backup": False, "min_workers": 2, "max_workers": 2, "total_steps": 400,
        "eval_every": 0, "seed": 1,
    })
    result = job.wait(timeout=480)
    assert result.status == "completed", result.message
    assert result.metrics["eval_accuracy"] >= 0.95, result.metrics
    sources = {p["source"] for p in job.metrics() if "bytes_up" in p}
    assert len(sources) == 4, sources
    client.close()
