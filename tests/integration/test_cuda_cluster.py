"""The whole system with its workers on a CUDA device: CLI clusters in each mode and precision (skipped without one).

Each worker node sees the GPU, so its rank trains on cuda:0 in a one-rank NCCL group, pushes
and pulls through the CPU shards, and (fp16) scales its loss dynamically. Several worker nodes
share the one GPU, as spot machines of one host would.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import MakeCluster

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.skipif(GPUS < 1, reason="no CUDA device: these clusters train on the GPU"),
              pytest.mark.timeout(420)]

DIGITS: dict[str, Any] = {
    "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data", "optimizer": "sgd",
    "lr": 0.1, "momentum": 0.5, "num_ps_shards": 1, "ps_backup": False, "min_workers": 2, "max_workers": 2,
    "eval_every": 0, "total_steps": 400, "seed": 0,
}


def _run(make_cluster: MakeCluster, spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """The run's final metrics and its time series ("history"), after checking no role was lost."""
    cluster: LocalCluster = make_cluster(**({"env": env} if env else {}))
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.wait_joined("ps")
    for i in range(2):
        cluster.add_node(f"w{i}", spot=True)
    client = Client(address)
    try:
        deadline = time.monotonic() + 120
        while sum(n["state"] == "ready" for n in client.nodes()) < 3:
            assert time.monotonic() < deadline, client.nodes()
            time.sleep(0.2)
        assert all(n["gpus"] >= 1 for n in client.nodes()), client.nodes()
        job = client.submit(spec)
        result = job.wait(timeout=360)
        assert result.status == "completed", result.message
        assert result.metrics["steps"] == spec["total_steps"]
        # No role failed on the way: a replacement would finish the run and hide a CUDA-only error.
        lost = [e for e in job.events() if e["kind"] in ("lost", "reassign", "restore", "degraded")]
        assert not lost, lost
        return {**result.metrics, "history": job.metrics()}
    finally:
        client.close()


@pytest.mark.parametrize(("mode", "precision", "compression"), [
    ("async", "fp16", "none"), ("async", "bf16", "topk:0.1"), ("sync", "fp16", "int8"), ("sync", "fp32", "none"),
    ("diloco", "bf16", "none"), ("gossip", "fp16", "fp16"),
])
def test_digits_trains_on_the_gpu(make_cluster: MakeCluster, mode: str, precision: str, compression: str) -> None:
    spec = {**DIGITS, "name": f"cuda-{mode}-{precision}", "mode": mode, "precision": precision,
            "compression": compression}
    spec.update({"global_batch_size": 64} if mode == "sync" else {"batch_size": 32})
    if mode == "diloco":
        spec.update(inner_steps=10, outer_momentum=0.6)
    if mode == "gossip":
        spec.update(num_ps_shards=0)
    metrics = _run(make_cluster, spec)
    print(f"{mode} {precision} {compression}: accuracy {metrics['eval_accuracy']:.4f} loss {metrics['eval_loss']:.4f}")
    assert metrics["eval_accuracy"] >= 0.9, metrics
    if mode == "gossip":  # the lead averaged its peers' parameters (CPU snapshots) with its own (on the GPU)
        peers = [p["gossip_peers"] for p in metrics["history"] if "gossip_peers" in p]
        assert peers and peers[-1] == 2, peers


def test_a_transformers_lm_trains_in_fp16_on_the_gpu(make_cluster: MakeCluster) -> None:
    pytest.importorskip("transformers")
    from gossamer.examples import gpt2

    seq = 64
    spec = {"name": "cuda-hf", "mode": "async", "model": "gossamer.examples.gpt2:model",
            "dataset": "gossamer.examples.gpt2:data", "loss": "model", "precision": "fp16",
            "model_args": {"arch": "llama", "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": seq},
            "dataset_args": {"seq_len": seq}, "optimizer": "adamw", "lr": 3e-3, "num_ps_shards": 1,
            "ps_backup": False, "min_workers": 2, "max_workers": 2, "eval_every": 0, "batch_size": 32,
            "total_steps": 150}
    metrics = _run(make_cluster, spec, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    _, held = gpt2.data(seq_len=seq)
    unigram = gpt2.unigram_entropy(held.targets())
    print(f"fp16 llama: eval {metrics['eval_loss']:.3f} nats/byte vs unigram {unigram:.3f}")
    assert metrics["eval_loss"] < 0.85 * unigram, (metrics, unigram)
