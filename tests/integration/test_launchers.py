"""`gossamer worker join` under torchrun and srun: one node agent per node, the other local ranks attach to it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import MakeCluster, ranks_env

pytestmark = pytest.mark.timeout(300)
_LAUNCHER_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "GOSSAMER_NPROC_PER_NODE", "GOSSAMER_RUN_DIR")


def _clean_env() -> dict[str, str]:
    """This test's environment without any launcher of its own (pytest itself may run under Slurm), on CPU
    where fewer than its 2 local ranks' GPUs are visible."""
    return {k: v for k, v in os.environ.items()
            if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))} | {"PYTHONUNBUFFERED": "1"} | ranks_env(2)


def _srun_env(local_id: int, job_id: str) -> dict[str, str]:
    """What srun --ntasks-per-node=2 sets for task `local_id` of a one-node step."""
    return _clean_env() | {
        "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(local_id), "SLURM_LOCALID": str(local_id),
        "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0",
    }


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[1]), int(fields[3])


def _in_sessions(sessions: set[int]) -> list[int]:
    """Live processes of these sessions (a launched process and everything it spawned)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None and st[1] in sessions:
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                out.append(int(d))
    return out


def _wait_gone(sessions: set[int], timeout: float = 10.0) -> None:
    """Every process of these sessions exits within `timeout` (helpers such as multiprocessing's
    resource tracker follow their parent within a moment)."""
    deadline = time.monotonic() + timeout
    while left := _in_sessions(sessions):
        if time.monotonic() > deadline:
            cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in left]
            raise AssertionError(f"still running: {cmdlines}")
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) and st[0] == pid]


def _kill_sessions(sessions: set[int]) -> None:
    for sid in sessions:
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_nodes(client: Client, names: set[str], timeout: float = 90) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = client.nodes()
        ready = {n["name"]: n for n in nodes if n["state"] == "ready"}
        if names <= set(ready):
            return ready
        assert time.monotonic() < deadline, nodes
        time.sleep(0.2)


def _train_on_two_local_ranks(client: Client, node: str) -> None:
    """A small async digits run: the launched node is the worker (shards prefer the on-demand 'ps')."""
    job = client.submit({
        "name": f"launched-{node}", "model": "gossamer.examples.digits:mlp",
        "dataset": "gossamer.examples.digits:data", "mode": "async", "num_ps_shards": 1, "chunk_numel": 4096,
        "min_workers": 1, "max_workers": 1, "total_steps": 300, "eval_every": 100,
    })
    result = job.wait(timeout=200)
    assert result.status == "completed", result.message
    assert result.metrics["steps"] == 300
    worker_nodes = {r["node"] for r in job.status()["roles"] if r["role"] == "worker"}
    assert worker_nodes == {node}
    node_id = next(n["id"] for n in client.nodes() if n["name"] == node)
    sources = {p["source"] for p in job.metrics() if "bytes_up" in p}
    # Both local ranks trained and exchanged their own chunks with the shard.
    assert sources == {f"{node_id}/0", f"{node_id}/1"}, sources


@pytest.fixture
def cluster_with_shard_host(tmp_path: Path, make_cluster: MakeCluster) -> Iterator[tuple[LocalCluster, Client]]:
    with make_cluster(state_dir=tmp_path / "cluster", env=_clean_env()) as cluster:
        cluster.start_coordinator(port=0)
        cluster.add_node("ps")
        client = Client(cluster.address)
        _wait_nodes(client, {"ps"})
        try:
            yield cluster, client
        finally:
            client.close()


def test_torchrun_two_processes_make_one_node_with_two_local_ranks(
        cluster_with_shard_host: tuple[LocalCluster, Client], tmp_path: Path) -> None:
    cluster, client = cluster_with_shard_host
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "gossamer.tools.cli", "worker", "join", cluster.address, "--name", "tr", "--spot", "--grace", "10"],
            stdout=out, stderr=subprocess.STDOUT, env=_clean_env(), start_new_session=True)
    sessions = {torchrun.pid}
    try:
        ready = _wait_nodes(client, {"ps", "tr"})
        ranks = _children(torchrun.pid)  # torchrun starts each local rank in its own session
        sessions |= set(ranks)
        assert len(ranks) == 2, log.read_text()
        assert len(client.nodes()) == 2, client.nodes()  # the two torchrun processes joined as one node
        assert ready["tr"]["nproc_per_node"] == 2
        _train_on_two_local_ranks(client, "tr")

        # The node agent is local rank 0: when it leaves, local rank 1 exits too and torchrun succeeds.
        agent = next(p for p in ranks if b"LOCAL_RANK=0\0" in Path(f"/proc/{p}/environ").read_bytes())
        os.kill(agent, signal.SIGTERM)
        assert torchrun.wait(timeout=60) == 0, log.read_text()
        assert {n["name"]: n["state"] for n in client.nodes()}["tr"] == "left"
        text = log.read_text()
        assert "local rank 1 of torchrun attached to the node agent" in text
        assert "local rank 1 attached" in text and "all 2 local ranks of torchrun are here" in text
        _wait_gone(sessions)
    finally:
        _kill_sessions(sessions)
        torchrun.wait(timeout=10)


def test_srun_tasks_on_one_node_make_one_node_with_two_local_ranks(
        cluster_with_shard_host: tuple[LocalCluster, Client], tmp_path: Path) -> None:
    cluster, client = cluster_with_shard_host
    job_id = str(uuid.uuid4().int % 10**6)
    run_dir = tempfile.mkdtemp(prefix="gsr-")  # short: a Unix socket path has 107 bytes
    tasks: list[subprocess.Popen[bytes]] = []
    try:
        for local_id in (1, 0):  # the attached rank first: it waits for its agent
            with open(tmp_path / f"task{local_id}.log", "wb") as out:
                tasks.append(subprocess.Popen(
                    [sys.executable, "-m", "gossamer.tools.cli", "worker", "join", cluster.address, "--name", "sr",
                     "--spot", "--grace", "10", "--run-dir", run_dir],
                    stdout=out, stderr=subprocess.STDOUT, env=_srun_env(local_id, job_id), start_new_session=True))
        ready = _wait_nodes(client, {"ps", "sr"})
        assert len(client.nodes()) == 2, client.nodes()
        assert ready["sr"]["nproc_per_node"] == 2
        _train_on_two_local_ranks(client, "sr")

        # srun passes a signal to every task: all leave, exit 0, and nothing they started is left.
        for t in tasks:
            t.send_signal(signal.SIGTERM)
        codes = [t.wait(timeout=60) for t in tasks]
        logs = {i: (tmp_path / f"task{i}.log").read_text() for i in (0, 1)}
        assert codes == [0, 0], logs
        assert {n["name"]: n["state"] for n in client.nodes()}["sr"] == "left"
        assert "local rank 1 of srun attached to the node agent" in logs[1]
        assert "started worker 0 rank 1 for the node agent" in logs[1]
        _wait_gone({t.pid for t in tasks})
        assert os.listdir(run_dir) == []  # the agent removed its socket
    finally:
        _kill_sessions({t.pid for t in tasks})
        for t in tasks:
            t.wait(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_dead_attached_rank_makes_the_agent_leave_with_an_error(tmp_path: Path, make_cluster: MakeCluster) -> None:
    with make_cluster(state_dir=tmp_path / "cluster", env=_clean_env()) as cluster:
        cluster.start_coordinator(port=0)
        client = Client(cluster.address)
        job_id = str(uuid.uuid4().int % 10**6)
        run_dir = tempfile.mkdtemp(prefix="gsr-")
        tasks: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for i in (0, 1):
                with open(tmp_path / f"t{i}.log", "wb") as out:
                    tasks[i] = subprocess.Popen(
                        [sys.executable, "-m", "gossamer.tools.cli", "worker", "join", cluster.address, "--name", "dead",
                         "--run-dir", run_dir],
                        stdout=out, stderr=subprocess.STDOUT, env=_srun_env(i, job_id), start_new_session=True)
            _wait_nodes(client, {"dead"})
            os.killpg(tasks[1].pid, signal.SIGKILL)  # local rank 1's machine slot vanishes
            assert tasks[0].wait(timeout=30) == 1
            assert "local rank(s) [1] of srun are gone: leaving" in (tmp_path / "t0.log").read_text()
            assert [n["state"] for n in client.nodes()] == ["left"]
        finally:
            _kill_sessions({t.pid for t in tasks.values()})
            for t in tasks.values():
                t.wait(timeout=10)
            client.close()
            shutil.rmtree(run_dir, ignore_errors=True)


def test_nproc_per_node_conflicting_with_the_launcher_exits_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gossamer.tools.cli", "worker", "join", "127.0.0.1:1", "--nproc-per-node", "3"],
        env=_srun_env(0, "1"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--nproc-per-node 3 conflicts with the 2 processes srun started on this node" in out.stderr


def test_an_attached_rank_without_its_agent_gives_up_with_a_clear_error() -> None:
    run_dir = tempfile.mkdtemp(prefix="gsr-")
    try:
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "gossamer.tools.cli", "worker", "join", "127.0.0.1:1", "--run-dir", run_dir,
             "--attach-timeout", "1"], env=_srun_env(1, "2"), capture_output=True, text=True, timeout=60)
        assert out.returncode == 3, out.stderr  # its node agent did not answer
        assert f"no node agent at {run_dir}/srun-" in out.stderr and "local rank 0 of this launch" in out.stderr
        assert time.monotonic() - t0 < 30
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_second_local_rank_0_is_refused_and_leaves_the_first_agents_socket_alone() -> None:
    run_dir = tempfile.mkdtemp(prefix="gsr-")
    cmd = [sys.executable, "-m", "gossamer.tools.cli", "worker", "join", "127.0.0.1:1", "--run-dir", run_dir]
    first = subprocess.Popen(cmd, env=_srun_env(0, "3"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not os.listdir(run_dir):  # the agent listens (for its local rank 1) before joining anyone
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        (sock,) = os.listdir(run_dir)
        second = subprocess.run(cmd, env=_srun_env(0, "3"), capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert "two processes claim local rank 0" in second.stderr
        assert os.listdir(run_dir) == [sock] and first.poll() is None
        first.send_signal(signal.SIGTERM)  # while it waits for local rank 1: it stops at once
        assert first.wait(timeout=20) == 0
        assert os.listdir(run_dir) == []
    finally:
        _kill_sessions({first.pid})
        first.wait(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)
