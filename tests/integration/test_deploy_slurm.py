"""deploy/slurm/gossamer.sbatch run for real: coordinator, agents and experiment; srun/scontrol stood in by scripts."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from gossamer.core.errors import GossamerError
from gossamer.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "gossamer.sbatch"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SRUN_SHIM = """#!/bin/bash
# srun stand-in: drops its options, starts the command once per node of the 'allocation', forwards TERM.
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
code=0
for p in "${pids[@]}"; do
    while true; do
        wait "$p"; rc=$?
        kill -0 "$p" 2>/dev/null || break
    done
    [[ $rc -ne 0 ]] && code=$rc
done
exit $code
"""
SCONTROL_SHIM = """#!/bin/bash
# scontrol stand-in: `scontrol show hostnames LIST` -> this machine.
echo localhost
"""


@dataclass
class SbatchRun:
    proc: subprocess.Popen[bytes]
    log: Path
    shared: Path
    job: str

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def port(self, timeout: float = 60) -> int:
        ready = self.shared / f"run-{self.job}" / "coordinator.port"
        deadline = time.monotonic() + timeout
        while not (ready.exists() and ready.read_text().strip()):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        return int(ready.read_text())

    def group(self) -> list[str]:
        """Live (non-zombie) processes still in the script's process group: PID and command line."""
        out = []
        for proc_stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = proc_stat.read_text().rsplit(")", 1)[1].split()
                cmd = (proc_stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                out.append(f"{proc_stat.parent.name}: {cmd}")
        return out

    def wait_group_gone(self, timeout: float = 10) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.group()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


@pytest.fixture
def sbatch(tmp_path: Path) -> Iterator[Callable[[str, list[str]], SbatchRun]]:
    """Runs the script as `sbatch` would on a one-node allocation: start(JOB_ID, ARGS)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN_SHIM), ("scontrol", SCONTROL_SHIM)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    runs: list[SbatchRun] = []

    def start(job: str, args: list[str]) -> SbatchRun:
        shared = tmp_path / "shared"  # the same across jobs, like a fixed SHARED_DIR
        env = {
            **os.environ,
            "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "node-0", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
            "SLURM_SUBMIT_DIR": str(tmp_path), "SHARED_DIR": str(shared), "SHARD_HOSTS": "1",
            "GOSSAMER_PORT": "0", "GOSSAMER_HTTP_PORT": "0", "GOSSAMER_GRACE": "10", "PYTHONUNBUFFERED": "1",
        }
        env.pop("SLURM_GPUS_ON_NODE", None)
        log = tmp_path / f"sbatch-{job}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(["bash", str(SBATCH), *args], stdout=f, stderr=subprocess.STDOUT,
                                    env=env, cwd=tmp_path, start_new_session=True)
        run = SbatchRun(proc, log, shared, job)
        runs.append(run)
        return run

    yield start
    for run in runs:  # whatever the test left running goes, by process group
        if run.group():
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=30)


def test_sbatch_job_stopped_by_sigterm_resumes_in_the_next_job_and_completes(
        sbatch: Callable[[str, list[str]], SbatchRun], tmp_path: Path) -> None:
    from gossamer import Client
    from gossamer.security.channel import ChannelSecurity

    exp = tmp_path / "exp.toml"
    exp.write_text(
        'name = "digits-slurm"\nmodel = "gossamer.examples.digits:mlp"\ndataset = "gossamer.examples.digits:data"\n'
        'mode = "async"\nlr = 0.05\nmomentum = 0.5\nbatch_size = 32\nnum_ps_shards = 1\nmin_workers = 1\n'
        # No backup replica: on a two-node allocation it would take the only node left for a worker.
        'max_workers = 1\nps_backup = false\ntotal_steps = 600\neval_every = 100\ncheckpoint_every = 50\nseed = 0\n'
    )
    # Job 1: coordinator, a shard host and the srun'd agent; stopped by the time limit's SIGTERM
    # once a shard checkpoint exists.
    run = sbatch("4242", [str(exp)])
    port = run.port()  # the coordinator made the secure directory before it served
    client = Client.secured(f"localhost:{port}", ChannelSecurity.from_flags(secure=str(run.shared / "secure")))

    def checkpointed() -> str | None:
        try:
            for e in client.experiments():
                if any(ev["kind"] == "checkpoint" for ev in client.job(e["id"]).events()):
                    return str(e["id"])
        except GossamerError as err:
            raise AssertionError(f"{err}\n{run.output()}") from None
        return None

    deadline = time.monotonic() + 240
    while (exp_id := checkpointed()) is None:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output()
        time.sleep(0.5)
    client.close()
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)  # what `#SBATCH --signal=B:TERM@120` sends
    code = run.proc.wait(timeout=90)
    out = run.output()
    assert code == 143, out
    # The script gives the coordinator 20 s to stop (then kills it), the nodes --grace (10 s).
    assert time.monotonic() - t0 < 20 + 10 + 15, out
    assert out.count("left the cluster") == 2, out  # the shard host and the srun'd agent
    assert not run.wait_group_gone(), f"processes outlived the batch script: {run.group()}"
    # The experiment stays running in the state directory, not failed for want of nodes.
    with closing(sqlite3.connect(run.shared / "state" / "coordinator.sqlite")) as db:
        (data,) = db.execute("SELECT data FROM experiments WHERE id = ?", (exp_id,)).fetchone()
    assert json.loads(data)["state"] == pb.EXPERIMENT_STATE_RUNNING, data
    # Only this user's jobs can read the generated CA, certificates and token.
    assert stat.S_IMODE((run.shared / "secure").stat().st_mode) == 0o700

    # Job 2 on the same state dir follows the experiment: the shard is restored from its
    # checkpoint on the new nodes and training runs to the end.
    run = sbatch("4243", ["--watch", exp_id])
    code = run.proc.wait(timeout=360)
    out = run.output()
    assert code == 0, out
    assert re.search(r"restored from \S+/shards/step-\d+", out), out
    assert re.search(r"^completed: ", out, re.M), out
    acc = float(re.search(r"final eval accuracy: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert acc > 0.8, out
    ckpt = Path(re.search(r"^checkpoint: (\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    assert ckpt.is_relative_to(run.shared / "state" / "checkpoints") and ckpt.exists(), ckpt
    assert out.count("left the cluster") == 2, out
    assert not run.wait_group_gone(), f"processes outlived the batch script: {run.group()}"
