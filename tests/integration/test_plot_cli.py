"""`gossamer plot` and `gossamer watch` against a real run: a coordinator and three nodes as processes.

The cluster logs in JSON (GOSSAMER_LOG_FORMAT=json), so the role processes' lines are
checked here too: they carry the node, the experiment and the role.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gossamer import Client, Experiment
from gossamer.tools.local_cluster import LocalCluster
from gossamer.tools.plot import render
from tests._fixtures import CLUSTER_DEFAULTS

pytestmark = pytest.mark.timeout(420)


@dataclass
class Run:
    cluster: LocalCluster
    client: Client
    exp_id: str
    watch_rc: int
    watch_out: str


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with LocalCluster(tmp_path_factory.mktemp("plot"), **CLUSTER_DEFAULTS,
                      env={"GOSSAMER_LOG_FORMAT": "json"}) as cluster:
        address = cluster.start_coordinator(port=0)
        cluster.add_node("od0")
        cluster.add_node("w0", spot=True)
        cluster.add_node("w1", spot=True)
        client = Client(address)
        deadline = time.monotonic() + 120
        while sum(n["state"] == "ready" for n in client.nodes()) < 3:
            assert time.monotonic() < deadline, client.nodes()
            time.sleep(0.2)
        job = client.submit(Experiment(
            name="plot", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
            mode="async", lr=0.05, momentum=0.5, num_ps_shards=1, ps_backup=False, min_workers=2, max_workers=2,
            total_steps=1200, eval_every=200, compression="int8"))
        # `watch` follows the run live from the start, in its own process, until it finishes.
        watcher = subprocess.Popen([sys.executable, "-m", "gossamer.tools.cli", "watch", job.id, "-c", address],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            result = job.wait(timeout=240)
            out, _ = watcher.communicate(timeout=30)
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait()
        assert result.status == "completed", result
        yield Run(cluster, client, job.id, watcher.returncode, out)
        client.close()


def test_plot_writes_a_png_of_four_panels_with_data(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    res = _cli("plot", run.exp_id, "--out", str(out), "-c", run.cluster.address)
    assert res.returncode == 0, res.stdout + res.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 30_000 < len(data) < 2_000_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1100, 750)
    fig = render(run.client.job(run.exp_id).metrics())
    for ax in fig.get_axes():
        lengths = [len(line.get_xdata()) for line in ax.get_lines()]  # type: ignore[arg-type]
        assert max(lengths, default=0) >= 2, (ax.get_title(), lengths)


def test_plot_of_an_unknown_experiment_is_a_clear_error(run: Run, tmp_path: Path) -> None:
    res = _cli("plot", "no-such-exp", "--out", str(tmp_path / "y.png"), "-c", run.cluster.address)
    assert res.returncode == 1
    assert res.stderr.startswith("gossamer: error:") and "no-such-exp" in res.stderr
    assert not (tmp_path / "y.png").exists()


def test_watch_followed_the_run_live_and_ended_with_the_summary(run: Run) -> None:
    assert run.watch_rc == 0, run.watch_out
    assert "roles" in run.watch_out and "w0" in run.watch_out and "worker" in run.watch_out
    assert "completed" in run.watch_out and "eval accuracy" in run.watch_out
    assert "checkpoint" in run.watch_out


def test_ctrl_c_detaches_watch_and_the_experiment_goes_on(run: Run, tmp_path: Path) -> None:
    # More workers than the cluster has: it stays queued, reports no points, and is ours to cancel.
    queued = run.client.submit(Experiment(
        name="queued", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
        num_ps_shards=1, min_workers=8, max_workers=8))
    try:
        res = _cli("plot", queued.id, "--out", str(tmp_path / "z.png"), "-c", run.cluster.address)
        assert res.returncode == 1 and "no metric points yet" in res.stderr, res.stderr

        watcher = subprocess.Popen([sys.executable, "-m", "gossamer.tools.cli", "watch", queued.id, "-c",
                                    run.cluster.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert watcher.stderr is not None
            assert watcher.stderr.readline().startswith(f"following {queued.id}")
            time.sleep(2.5)  # a few refreshes
            assert watcher.poll() is None
            watcher.send_signal(signal.SIGINT)
            out, err = watcher.communicate(timeout=30)
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait()
        assert watcher.returncode == 130, out + err
        assert "detached" in out and "queued" in err
        assert queued.status()["state"] == "queued"  # not cancelled
    finally:
        queued.cancel()


def test_role_processes_log_json_lines_with_node_experiment_and_role(run: Run) -> None:
    lines = (run.cluster.log_dir / "w0.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    trainer = [r for r in records if r.get("experiment") == run.exp_id]
    assert trainer and all(r["node"] == "w0" and r["role"].startswith("w") for r in trainer)
    agent = [r for r in records if r.get("role") == "agent"]
    assert agent and agent[-1]["node"] == "w0"
