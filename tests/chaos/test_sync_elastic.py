"""Sync mode under churn: the barrier re-forms on kill -9, grows on join, and a SIGTERM'd primary hands over.

With `global_batch_size` set the global batch of every step is the same samples whatever the
number of workers, so the run must end where plain single-process training ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gossamer import Client, Experiment, load_checkpoint
from gossamer.engine.model import build
from gossamer.paramserver import flatten_params
from tests._fixtures import MakeCluster
from tests.chaos._wait import assert_running, wait_for, wait_steps
from tests.integration._ps_harness import reference_sync

pytestmark = pytest.mark.timeout(420)



def test_sync_barrier_reforms_grows_and_survives_a_primary_handover(tmp_path: Path, make_cluster: MakeCluster) -> None:
    spec = {
        "name": "sync-elastic", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "sync", "lr": 0.1, "momentum": 0.9, "global_batch_size": 96, "num_ps_shards": 1,
        "min_workers": 2, "max_workers": 3, "total_steps": 700, "eval_every": 0, "checkpoint_every": 0,
    }
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps-a")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps-a")
        cluster.add_node("ps-b")
        slow = {"GOSSAMER_FAULT": "delay:seconds=0.03"}  # lets the churn land mid-run
        for name in ("w0", "w1", "w2"):
            cluster.add_node(name, spot=True, env=slow)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 5, 60, "nodes")
        job = client.submit(spec)
        wait_steps(job, 100, 120, "100 steps")
        cluster.kill_node("w1")  # mid-step, surely: the survivors wait on its contribution
        assert_running(job, "the kill of w1")
        wait_steps(job, 250, 120, "steps after the kill")
        cluster.add_node("w3", spot=True, env=slow)  # joins the barrier at the next step
        assert_running(job, "the join of w3")
        wait_for(lambda: any(e["kind"] == "ready" and "on w3" in e["message"] for e in job.events()), 120, "w3")
        wait_steps(job, 450, 120, "steps after the join")
        assert cluster.stop_node("ps-a", timeout=30) == 0  # spot notice on the primary's machine
        assert_running(job, "the SIGTERM of ps-a")
        result = job.wait(timeout=240)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert any(e["kind"] == "lost" and "node w1 " in e["message"] for e in events), text
    assert any(e["kind"] == "reassign" and "node w3 joins as worker" in e["message"] for e in events), text
    assert any(e["kind"] == "leave" and "node ps-a " in e["message"] for e in events), text
    assert any(e["kind"] == "promote" and "backup on ps-b promoted" in e["message"] for e in events), text
    assert not any(e["kind"] == "restore" for e in events), text  # a handover, not a loss
    assert result.metrics["redone_steps"] >= 1  # the step the kill interrupted was computed again
    assert result.metrics.get("discarded_reform", 0) >= 1
    # Same global batches, same optimizer: where single-process training ends, up to the
    # order of float sums (workers split each batch differently as membership changes).
    exp = Experiment.from_dict({**spec})
    model, _, _ = build(exp, torch.device("cpu"))
    model.load_state_dict(load_checkpoint(result.checkpoint))
    ours, ref = flatten_params(model), reference_sync(exp, 96)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-3), float((ours - ref).abs().max())
