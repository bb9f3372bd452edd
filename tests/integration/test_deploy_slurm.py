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

from gossamer.errors import GossamerError
from gossamer.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "gossamer.sbatch"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

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

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def port(self, timeout: float = 60) -> int:
        ready = self.shared / "run-4242" / "coordinator.port"
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
def sbatch(tmp_path: Path) -> Iterator[Callable[[int], SbatchRun]]:
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN_SHIM), ("scontrol", SCONTROL_SHIM)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    runs: list[SbatchRun] = []

    def start(total_steps: int) -> SbatchRun:
        exp = tmp_path / "exp.toml"
        exp.write_text(
            'name = "digits-slurm"\nmodel = "gossamer.examples.digits:mlp"\ndataset = "gossamer.examples.digits:data"\n'
            f'mode = "async"\nlr = 0.05\nmomentum = 0.5\nbatch_size = 32\nnum_ps_shards = 1\nmin_workers = 1\n'
            f'max_workers = 1\nps_backup = false\ntotal_steps = {total_steps}\neval_every = 100\ncheckpoint_every = 100\n'
            'seed = 0\n'
        )
        shared = tmp_path / "shared"
        env = {
            **os.environ,
            "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-0", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
            "SLURM_SUBMIT_DIR": str(tmp_path), "SHARED_DIR": str(shared), "SHARD_HOSTS": "1",
            "GOSSAMER_PORT": "0", "GOSSAMER_HTTP_PORT": "0", "GOSSAMER_GRACE": "10", "PYTHONUNBUFFERED": "1",
        }
        env.pop("SLURM_GPUS_ON_NODE", None)
        log = tmp_path / "sbatch.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(["bash", str(SBATCH), str(exp)], stdout=f, stderr=subprocess.STDOUT,
                                    env=env, cwd=tmp_path, start_new_session=True)
        run = SbatchRun(proc, log, shared)
        runs.append(run)
        return run

    yield start
    for run in runs:  # whatever the test left running goes, by process group
        if run.group():
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=30)


def test_sbatch_script_runs_an_experiment_to_the_end_and_cleans_up(sbatch: Callable[[int], SbatchRun]) -> None:
    run = sbatch(200)
    code = run.proc.wait(timeout=240)
    out = run.output()
    assert code == 0, out
    assert re.search(r"^completed: ", out, re.M), out
    acc = float(re.search(r"final eval accuracy: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert acc > 0.8, out
    # The final model went under the state dir on the shared directory.
    ckpt = re.search(r"^checkpoint: (\S+)", out, re.M).group(1)  # type: ignore[union-attr]
    assert Path(ckpt).is_relative_to(run.shared / "state" / "checkpoints") and Path(ckpt).exists(), ckpt
    assert out.count("left the cluster") == 2, out  # the shard host and the srun'd agent
    assert not run.wait_group_gone(), f"processes outlived the batch script: {run.group()}"


def test_sbatch_script_on_sigterm_nodes_leave_gracefully_and_nothing_is_left(sbatch: Callable[[int], SbatchRun]) -> None:
    from gossamer import Client
    from gossamer.security.channel import ChannelSecurity

    run = sbatch(100_000)
    port = run.port()  # the script made its secure directory before the coordinator served
    client = Client.secured(f"localhost:{port}", ChannelSecurity.from_flags(secure=str(run.shared / "secure")))

    def steps_running() -> int:
        try:
            return max((e["steps"] for e in client.experiments() if e["state"] == "running"), default=0)
        except GossamerError as e:
            raise AssertionError(f"{e}\n{run.output()}") from None

    deadline = time.monotonic() + 180
    while steps_running() <= 20:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output()
        time.sleep(0.5)
    client.close()
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)  # what `#SBATCH --signal=B:TERM@120` sends
    code = run.proc.wait(timeout=60)
    out = run.output()
    assert code == 143, out
    assert time.monotonic() - t0 < 10 + 15, "longer than --grace plus the coordinator's stop"
    assert out.count("left the cluster") == 2, out
    # The experiment stays in the state directory, running, for a later job to resume.
    with closing(sqlite3.connect(run.shared / "state" / "coordinator.sqlite")) as db:
        (data,) = db.execute("SELECT data FROM experiments").fetchone()
    assert json.loads(data)["state"] == pb.EXPERIMENT_STATE_RUNNING, data
    # Only this user's jobs can read the generated CA, certificates and token.
    assert stat.S_IMODE((run.shared / "secure").stat().st_mode) == 0o700
    assert not run.wait_group_gone(), f"processes outlived the batch script: {run.group()}"
