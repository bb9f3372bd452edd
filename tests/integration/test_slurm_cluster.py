"""deploy/slurm/gossamer.sbatch under a real Slurm (slurmctld + one slurmd per namespace host): a run to the end, and one preempted mid-run."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from bench._slurm import (
    FINISHED,
    Partition,
    SlurmCluster,
    SlurmConfig,
    SlurmUnavailable,
    unavailable_reason,
)
from gossamer.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "gossamer.sbatch"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

NODES = 3
GRACE_S = 10  # the nodes' --grace (GOSSAMER_GRACE)
#: The spot partition's GraceTime: the preempted job's steps get SIGTERM, the job ends this much later.
PREEMPT_GRACE_S = 20
#: The recipe of docs/deploy.md, "Slurm on spot/preemptible partitions".
SPOT = SlurmConfig(
    nodes=NODES, preempt_type="preempt/partition_prio", kill_wait_s=GRACE_S + 30,
    partitions=(Partition(name="spot", default=True, priority_tier=1, preempt_mode="REQUEUE",
                          grace_time_s=PREEMPT_GRACE_S),
                Partition(name="urgent", priority_tier=10)))
EXPERIMENT = (
    'name = "digits-slurm"\nmodel = "gossamer.examples.digits:mlp"\ndataset = "gossamer.examples.digits:data"\n'
    'mode = "async"\nlr = 0.05\nmomentum = 0.5\nbatch_size = 32\nnum_ps_shards = 1\nmin_workers = 1\n'
    'max_workers = 3\nps_backup = false\ntotal_steps = {steps}\neval_every = 200\ncheckpoint_every = 100\nseed = 0\n')


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    why = unavailable_reason()
    if why:
        pytest.skip(f"no Slurm cluster here: {why}")
    try:
        cluster = SlurmCluster(SPOT, tmp_path / "slurm").start()
    except SlurmUnavailable as e:
        pytest.skip(f"Slurm did not start here: {e}")
    try:
        yield cluster
    finally:
        cluster.close()
        assert not cluster.net.leftovers()


def job_env() -> dict[str, str]:
    """What the user's shell holds at sbatch time (sbatch passes it on): gossamer on PATH, the script's knobs."""
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "SHARD_HOSTS": "1", "GOSSAMER_PORT": "0", "GOSSAMER_HTTP_PORT": "0", "GOSSAMER_GRACE": str(GRACE_S),
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def sbatch_args(*extra: str, nodes: str = str(NODES)) -> list[str]:
    # The script asks for 8 GPUs and 32 CPUs a node; these CPU-only nodes have neither.
    return ["--partition=spot", f"--nodes={nodes}", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count() or 1}",
            "--time=15", *extra]


def state_db(tmp_path: Path, job: str) -> Path:
    return tmp_path / f"gossamer-{job}" / "state" / "coordinator.sqlite"


def query(db: Path, sql: str, *args: object) -> list[tuple[object, ...]]:
    if not db.exists():
        return []
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as c:
            return c.execute(sql, args).fetchall()
    except sqlite3.OperationalError:  # not created yet
        return []


def job_output(tmp_path: Path, job: str) -> str:
    out = tmp_path / f"gossamer-{job}.out"
    return out.read_text(errors="replace") if out.exists() else ""


def finished_experiment(tmp_path: Path, job: str) -> tuple[dict[str, object], str]:
    """The one experiment in the job's state directory (its stored record) and the job's output."""
    out = job_output(tmp_path, job)
    rows = query(state_db(tmp_path, job), "SELECT id, data FROM experiments")
    assert len(rows) == 1, (rows, out)
    return json.loads(str(rows[0][1])), out


def test_sbatch_runs_the_experiment_to_completion_across_the_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    exp = tmp_path / "exp.toml"
    exp.write_text(EXPERIMENT.format(steps=400))
    job = slurm.sbatch([*sbatch_args(), str(SBATCH), str(exp)], env=job_env(), cwd=tmp_path)
    info = slurm.wait_state(job, FINISHED, timeout=300)
    data, out = finished_experiment(tmp_path, job)
    assert info["JobState"] == "COMPLETED", (info, out)
    assert info["NodeList"] == f"node[1-{NODES}]", info
    assert re.search(r"^completed: ", out, re.M), out
    assert data["state"] == pb.EXPERIMENT_STATE_COMPLETED, data
    ckpt = Path(re.search(r"^checkpoint: (\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    assert ckpt.is_relative_to(tmp_path / f"gossamer-{job}" / "state" / "checkpoints") and ckpt.exists(), ckpt
    # Every node's agent took part: one agent per node from srun, plus the shard host on the first.
    hosts = {json.loads(str(d)).get("hostname") for (d,) in query(state_db(tmp_path, job), "SELECT data FROM nodes")}
    assert {f"node{i}" for i in range(1, NODES + 1)} <= hosts, hosts


def steps_done(db: Path) -> int:
    """The furthest step the coordinator has recorded for the run."""
    rows = query(db, "SELECT MAX(step) FROM metrics")
    return int(str(rows[0][0] or 0)) if rows else 0


def test_preempted_job_leaves_gracefully_is_requeued_and_completes_the_experiment(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    total = 2400
    exp = tmp_path / "exp.toml"
    exp.write_text(EXPERIMENT.format(steps=total))
    # 20 ms a step: the run lasts long enough on any machine for the preemption to land mid-run.
    env = {**job_env(), "GOSSAMER_FAULT": "delay:seconds=0.02"}
    job = slurm.sbatch([*sbatch_args("--requeue", nodes=f"2-{NODES}"), str(SBATCH), str(exp)], env=env,
                       cwd=tmp_path)
    db = state_db(tmp_path, job)

    # The urgent job comes once the run is past a checkpoint, far from its end.
    deadline = time.monotonic() + 150
    while steps_done(db) < 600:
        info = slurm.job(job)
        assert info["JobState"] in ("PENDING", "RUNNING") and time.monotonic() < deadline, (info, job_output(tmp_path, job))
        time.sleep(0.5)
    urgent = slurm.sbatch(["--partition=urgent", "--nodes=1", "--output=/dev/null", "--wrap", "sleep 120"], cwd=tmp_path)
    deadline = time.monotonic() + 30
    while (info := slurm.job(job)).get("PreemptTime", "None") == "None":
        assert time.monotonic() < deadline, (info, slurm.controller_log()[-3000:])
        time.sleep(0.2)
    at_preemption = steps_done(db)
    (state,) = query(db, "SELECT data FROM experiments")[0]
    assert at_preemption < total and json.loads(str(state))["state"] == pb.EXPERIMENT_STATE_RUNNING, at_preemption

    # The steps got SIGTERM: every srun'd agent leaves gracefully while the shard host and the
    # coordinator (the batch step, not signalled) keep the experiment; GraceTime later the job ends
    # and is requeued. Slurm's periodic check finds the grace over up to ~15 s late.
    info = slurm.wait_state(job, {"PENDING"}, timeout=PREEMPT_GRACE_S + 30 + SPOT.kill_wait_s + 30)
    assert info["Restarts"] == "1", info
    first = job_output(tmp_path, job)
    assert first.count("left the cluster") == NODES + 1, first  # the srun'd agents, then the shard host
    assert "DUE TO PREEMPTION" in first, first
    # Slurm holds a requeued job for two minutes (BeginTime); a user may release it at once.
    slurm.command(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    info = slurm.wait_state(job, {"RUNNING"}, timeout=60)
    taken = slurm.job(urgent)["NodeList"]
    assert taken and taken not in info["NodeList"], (taken, info["NodeList"])  # the run goes on without it
    info = slurm.wait_state(job, FINISHED, timeout=240)
    data, out = finished_experiment(tmp_path, job)  # one experiment: the requeued run did not submit it again
    assert info["JobState"] == "COMPLETED", (info, out)
    assert re.search(r"requeued \(restart 1\): following " + re.escape(str(data["id"])), out), out
    assert data["state"] == pb.EXPERIMENT_STATE_COMPLETED and steps_done(db) == total, (data, steps_done(db))
    events = [(str(k), str(m)) for k, m in query(db, "SELECT kind, message FROM events ORDER BY id")]
    left = [m for k, m in events if k == "leave" and m.endswith("left: signal")]
    assert len(left) >= NODES, events  # each preempted agent said it left; none was found lost
    lost_nodes = [m for k, m in events if k == "lost" and "-shards-" not in m]
    assert not lost_nodes, (lost_nodes, events, job_output(tmp_path, job)[-6000:])
    # The shard host, stopped gracefully at the job's end, wrote the shard's final checkpoint before it
    # left (the coordinator already gone): the requeued run restores it from there and loses nothing.
    (restored,) = [m for k, m in events if k == "restored"]
    lost = int(re.search(r"(\d+) version\(s\) lost", restored).group(1))  # type: ignore[union-attr]
    assert lost == 0, restored
    (final,) = [m for k, m in events if k == "checkpoint" and m.startswith("final checkpoint")]
    assert Path(final.rsplit(": ", 1)[1]).exists(), final
