"""fp16 in a user's own loop: torch's GradScaler around the prepared optimizer, an overflow skipped in every mode."""

from __future__ import annotations

import pytest

import gossamer
from gossamer.core.experiment import Experiment
from gossamer.tools.local_cluster import LocalCluster
from tests.integration._cli_cluster import spot_cluster

pytestmark = pytest.mark.timeout(420)

U = "tests.integration._user_loop"
SHARDS = {"num_ps_shards": 1, "ps_backup": False}


def test_sync_workers_skip_one_workers_overflow_together_and_stay_identical(cluster: LocalCluster) -> None:
    # The mean gradient of a step where one worker overflowed is inf on every worker: GradScaler skips the step
    # on all of them and halves the scale on all of them.
    _, client = spot_cluster(cluster, workers=2)
    job = client.submit({"name": "fp16-sync", "train": f"{U}:train_fp16", "mode": "sync", "total_steps": 30,
                         "min_workers": 2, "max_workers": 2, "global_batch_size": 16, **SHARDS})
    result = job.wait(timeout=300)
    points = [p for p in job.metrics() if "checksum" in p]
    client.close()
    assert result.status == "completed", result.message
    assert sorted(p["rank"] for p in points) == [0.0, 1.0], points
    assert {p["scale"] for p in points} == {2.0**9}, points  # one overflow, seen by both
    assert len({p["checksum"] for p in points}) == 1, points


def test_async_skips_the_overflowed_step_and_one_worker_ends_with_one_plain_process_parameters(
        cluster: LocalCluster) -> None:
    # A skipped step changes nothing, so nothing goes to the shards: alone, the worker's run is the plain one.
    _, client = spot_cluster(cluster, workers=1)
    job = client.submit({"name": "fp16-async", "train": f"{U}:train_fp16", "mode": "async", "total_steps": 30,
                         "min_workers": 1, "max_workers": 1, **SHARDS})
    result = job.wait(timeout=300)
    scales = [p["scale"] for p in job.metrics() if "scale" in p]
    client.close()
    assert result.status == "completed", result.message
    assert scales == [2.0**9], scales
    state = gossamer.load_checkpoint(result.checkpoint)
    plain = gossamer.run_local(Experiment(name="plain", train=f"{U}:train_fp16", mode="async", total_steps=30))
    gap = max((state[k] - plain[k]).abs().max().item() for k in plain)
    assert gap <= 1e-5, gap
