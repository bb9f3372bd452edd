"""A user's run: coordinator and nodes as separate processes, experiment submitted with the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gossamer import Client, load_checkpoint
from gossamer.engine.model import evaluate
from gossamer.examples.digits import data, mlp
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import ranks_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(420)


def _wait_ready(client: Client, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(x["state"] == "ready" for x in client.nodes()) < n:
        assert time.monotonic() < deadline, client.nodes()
        time.sleep(0.2)


def test_async_digits_three_workers_two_shards_via_cli(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    for i in range(2):
        cluster.add_node(f"od{i}")
    for i in range(3):
        cluster.add_node(f"spot{i}", spot=True)
    client = Client(address)
    _wait_ready(client, 5)
    out = subprocess.run(
        [sys.executable, "-m", "gossamer.tools.cli", "submit", str(ROOT / "examples" / "digits.toml"),
         "--coordinator", address, "--wait", "--quiet"],
        capture_output=True, text=True, timeout=360,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    exp_id = out.stdout.splitlines()[0].strip()
    acc = float(re.search(r"final eval accuracy: ([0-9.]+)", out.stdout).group(1))  # type: ignore[union-attr]
    assert acc >= 0.95, out.stdout

    result = client.job(exp_id).wait(timeout=30)
    assert result.status == "completed"
    m = result.metrics
    assert m["steps"] == 1500 and m["eval_accuracy"] == pytest.approx(acc, abs=1e-4)
    assert m["samples"] >= 1500 * 32 and m["bytes_up"] > 0 and m["bytes_down"] > 0
    # Roles went where they should: shards on the on-demand nodes, workers on spot nodes.
    st = client.job(exp_id).status()
    by_role = {(r["role"], r["node"]) for r in st["roles"]}
    assert {n for role, n in by_role if role == "ps"} == {"od0", "od1"}
    assert {n for role, n in by_role if role == "worker"} == {"spot0", "spot1", "spot2"}
    # The final checkpoint is a plain state_dict that reproduces the reported accuracy.
    model = mlp()
    model.load_state_dict(load_checkpoint(result.checkpoint))
    assert evaluate(model, data()[1], torch.device("cpu"))[0] == pytest.approx(acc, abs=1e-4)
    # The time series has eval points and rising steps; nodes are free again.
    series = client.job(exp_id).metrics()
    evals = [p for p in series if "eval_accuracy" in p]
    assert len(evals) >= 10 and evals[-1]["eval_accuracy"] == pytest.approx(acc, abs=1e-4)
    assert all(n["role"] == "" for n in client.nodes())
    status = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "status", exp_id, "-c", address],
                            capture_output=True, text=True, timeout=60)
    assert "completed" in status.stdout and "eval_accuracy" in status.stdout
    client.close()


def test_sigterm_leaves_cleanly_within_seconds(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    cluster.add_node("n0")
    client = Client(address)
    _wait_ready(client, 1)
    t0 = time.monotonic()
    code = cluster.stop_node("n0", timeout=10)
    elapsed = time.monotonic() - t0
    assert code == 0 and elapsed < 5
    assert [n["state"] for n in client.nodes()] == ["left"]
    client.close()


def test_cancel_stops_roles_and_frees_nodes(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    for i in range(2):
        cluster.add_node(f"n{i}")
    client = Client(address)
    _wait_ready(client, 2)
    job = client.submit({"name": "long", "model": "gossamer.examples.digits:mlp",
                         "dataset": "gossamer.examples.digits:data", "total_steps": 10**6, "min_workers": 1})
    deadline = time.monotonic() + 90
    while job.status()["steps"] < 20:
        assert time.monotonic() < deadline, job.status()
        time.sleep(0.2)
    out = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "cancel", job.id, "-c", address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "cancelled" in out.stdout
    assert job.wait(timeout=10).status == "cancelled"
    deadline = time.monotonic() + 30
    while any(n["role"] for n in client.nodes()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    steps = job.status()["steps"]
    time.sleep(2)
    assert job.status()["steps"] == steps  # nothing trains any more
    client.close()


def test_compressed_experiment_through_real_processes_reports_its_savings(cluster: LocalCluster) -> None:
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.wait_joined("ps")
    for i in range(2):
        cluster.add_node(f"w{i}", spot=True)
    client = Client(address)
    _wait_ready(client, 3)
    job = client.submit({
        "name": "compressed", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "compression": "topk:0.01", "pull_compression": "int8", "num_ps_shards": 1,
        "min_workers": 2, "max_workers": 2, "total_steps": 800, "eval_every": 200,
    })
    result = job.wait(timeout=240)
    assert result.status == "completed", result.message
    m = result.metrics
    assert m["compression_ratio"] >= 50  # raw fp32 bytes / bytes on the wire, pushes
    assert m["pull_compression_ratio"] >= 3.5
    assert m["bytes_up_per_step"] * 50 <= m["raw_bytes_up"] / m["updates"]
    assert m["eval_accuracy"] >= 0.9
    client.close()


def test_worker_node_with_two_local_ranks_trains_through_the_agent(cluster: LocalCluster) -> None:
    """`worker join --nproc-per-node 2`: two spawned ranks in one gloo group, each with its own chunks."""
    address = cluster.start_coordinator(port=0)
    cluster.add_node("ps")
    cluster.wait_joined("ps")
    cluster.add_node("w2", spot=True, nproc_per_node=2, env=ranks_env(2))
    client = Client(address)
    _wait_ready(client, 2)
    job = client.submit({
        "name": "two-ranks", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "num_ps_shards": 1, "chunk_numel": 4096, "min_workers": 1, "max_workers": 1,
        "total_steps": 600, "eval_every": 200,
    })
    result = job.wait(timeout=240)
    assert result.status == "completed", result.message
    series = job.metrics()
    sources = {p["source"] for p in series if "bytes_up" in p}
    assert len(sources) == 2  # both local ranks exchanged their own chunks with the shard
    assert result.metrics["eval_accuracy"] >= 0.9
    client.close()
