"""A user's own regression model, loss, endless stream and metrics train through the CLI cluster; bad user code is named."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import write_toml
from tests.integration._cli_cluster import cli, spot_cluster

pytestmark = pytest.mark.timeout(420)

U = "tests.integration._user_regression"
NOISE = 0.1  # the stream's noise std: the user's loss (half the squared error) floors at NOISE**2 / 2










def test_user_regression_with_own_loss_on_endless_stream_trains_to_noise_floor(cluster: LocalCluster,
                                                                                tmp_path: Path) -> None:
    address, client = spot_cluster(cluster, workers=2)
    spec = write_toml(tmp_path / "regression.toml", name="regression", mode="async", model=f"{U}:linear",
                 dataset=f"{U}:stream_data", loss=f"{U}:half_squared_error", metrics=f"{U}:regression_metrics",
                 optimizer="sgd", lr=0.05, batch_size=32, num_ps_shards=1, total_steps=400, eval_every=100,
                 ps_backup=False, min_workers=2, num_workers=1, prefetch=2)  # a DataLoader process per worker
    out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    exp_id = out.stdout.splitlines()[0].strip()
    result = client.job(exp_id).wait(timeout=30)
    assert result.status == "completed", result
    m = result.metrics
    floor = NOISE**2 / 2
    # From about 4 at the start (half of |w|^2 = 8 expected) to within a factor of the noise floor.
    assert floor / 2 <= m["eval_loss"] <= 2 * floor, m
    assert m["eval_r2"] > 0.99 and m["eval_mae"] < 2 * NOISE, m  # the user's own metrics came back
    assert "eval_accuracy" not in m and "eval_perplexity" not in m  # no classes, no tokens
    float(re.search(r"final eval loss: ([0-9.e-]+)", out.stdout).group(1))  # type: ignore[union-attr]
    # Both workers read the stream (disjoint pieces of it) and every eval reached the time series.
    evals = [p for p in client.job(exp_id).metrics() if "eval_r2" in p]
    assert len(evals) >= 3 and evals[-1]["eval_loss"] == pytest.approx(m["eval_loss"], rel=1e-6)
    status = cli("status", exp_id, "-c", address, timeout=60)
    assert "eval_r2" in status.stdout and "eval_mae" in status.stdout, status.stdout
    client.close()


def test_map_style_set_read_by_loader_processes_in_a_role_trains(cluster: LocalCluster, tmp_path: Path) -> None:
    """Role processes are forked by their node's fork server, so multiprocessing's default there is "forkserver":
    the loader's processes must still start (its collate is a closure, which that default cannot pickle)."""
    address, client = spot_cluster(cluster, workers=1)
    spec = write_toml(tmp_path / "mapped.toml", name="mapped", mode="async", model=f"{U}:linear",
                 dataset=f"{U}:tensor_data", loss="mse", optimizer="sgd", lr=0.05, batch_size=32,
                 num_ps_shards=1, total_steps=300, eval_every=0, ps_backup=False, num_workers=2, prefetch=2)
    out = cli("submit", str(spec), "--coordinator", address, "--wait", "--quiet")
    assert out.returncode == 0, out.stdout + out.stderr
    result = client.job(out.stdout.splitlines()[0].strip()).wait(timeout=30)
    assert result.status == "completed", result
    assert result.metrics["eval_loss"] < 4 * NOISE**2, result.metrics  # mse: from about 8 to the noise floor
    client.close()


def test_bad_user_code_is_refused_at_submit_or_named_in_status(cluster: LocalCluster, tmp_path: Path) -> None:
    """A loss that does not import: refused at submit. A loss returning per-sample values: the worker fails
    at its first step and `gossamer status` shows why, naming the `loss` field; its replacement fails
    alike, and the experiment fails."""
    address, client = spot_cluster(cluster, workers=1)
    base = dict(mode="async", model=f"{U}:linear", dataset=f"{U}:stream_data", optimizer="sgd", lr=0.05,
                num_ps_shards=1, total_steps=50, eval_every=0, ps_backup=False)
    missing = write_toml(tmp_path / "missing.toml", name="missing", **base, loss=f"{U}:no_such_loss")
    out = cli("submit", str(missing), "--coordinator", address, "--quiet", timeout=120)
    assert out.returncode != 0 and "loss" in out.stderr + out.stdout and "no_such_loss" in out.stderr + out.stdout

    bad = write_toml(tmp_path / "bad.toml", name="bad", **base, loss=f"{U}:per_sample_error")
    out = cli("submit", str(bad), "--coordinator", address, "--quiet", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    exp_id = out.stdout.splitlines()[0].strip()
    deadline, shown = time.monotonic() + 120, ""
    while "loss:" not in shown:
        assert time.monotonic() < deadline, shown
        shown = cli("status", exp_id, "-c", address, timeout=60).stdout
        time.sleep(0.5)
    assert "per_sample_error" in shown and "scalar" in shown, shown
    # Every worker would fail alike: the second such failure ends the run instead of restarting workers.
    result = client.job(exp_id).wait(timeout=120)
    assert result.status == "failed", result
    assert "per_sample_error" in result.message and "own `loss` failed 2 workers: not retried" in result.message
    client.close()
