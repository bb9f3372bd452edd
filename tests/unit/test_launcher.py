"""Launcher detection (torchrun, srun, none) from the environment, and where local ranks meet their agent."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from gossamer.core.errors import ConfigError
from gossamer.node.launcher import (
    Launch,
    check_cuda_ranks,
    default_run_dir,
    detect,
    ensure_run_dir,
    parse_tasks_per_node,
    resolve_nproc,
    scrub_cross_node_env,
    visible_cuda_devices,
)


def torchrun_env(local_rank: int, *, local_world: int = 2, group_rank: int = 0, nodes: int = 1,
                 run_id: str = "abc", port: str = "29500", restart: str = "0") -> dict[str, str]:
    """What torchrun 2.x sets for worker `local_rank` of node `group_rank`."""
    return {
        "LOCAL_RANK": str(local_rank), "RANK": str(group_rank * local_world + local_rank),
        "GROUP_RANK": str(group_rank), "ROLE_RANK": str(group_rank * local_world + local_rank),
        "LOCAL_WORLD_SIZE": str(local_world), "WORLD_SIZE": str(nodes * local_world),
        "GROUP_WORLD_SIZE": str(nodes), "ROLE_WORLD_SIZE": str(nodes * local_world),
        "MASTER_ADDR": "node0", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": restart,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def srun_env(procid: int, localid: int, nodeid: int, *, step: str = "0", **extra: str) -> dict[str, str]:
    """The srun step variables of one task (tasks per node as Slurm lays out 2 nodes x 3 tasks)."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": step, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_STEP_TASKS_PER_NODE": "3(x2)", "SLURM_TASKS_PER_NODE": "3(x2)", **extra,
    }


def test_no_launcher_means_one_process_per_node() -> None:
    launch = detect({"PATH": "/usr/bin", "HOME": "/root"})
    assert launch == Launch() and launch.source == "none" and not launch.shared
    assert (launch.local_rank, launch.local_world, launch.node_rank) == (0, 1, 0)


def test_torchrun_gives_local_rank_local_world_and_node_rank() -> None:
    launch = detect(torchrun_env(1, local_world=4, group_rank=2, nodes=3))
    assert launch.source == "torchrun"
    assert (launch.local_rank, launch.local_world, launch.node_rank) == (1, 4, 2)
    assert (launch.rank, launch.world) == (9, 12)
    assert launch.shared


def test_every_local_rank_of_a_node_agrees_on_the_socket_and_other_nodes_do_not(tmp_path: Path) -> None:
    same = {detect(torchrun_env(r)).socket_path(str(tmp_path)) for r in range(2)}
    assert len(same) == 1
    other_node = detect(torchrun_env(0, group_rank=1, nodes=2)).socket_path(str(tmp_path))
    other_run = detect(torchrun_env(0, run_id="xyz")).socket_path(str(tmp_path))
    restarted = detect(torchrun_env(0, restart="1")).socket_path(str(tmp_path))
    assert len(same | {other_node, other_run, restarted}) == 4
    assert next(iter(same)).startswith(str(tmp_path) + os.sep + "torchrun-")


def test_srun_local_world_comes_from_the_steps_tasks_per_node() -> None:
    launch = detect(srun_env(4, 1, 1))
    assert launch.source == "srun"
    assert (launch.local_rank, launch.local_world, launch.node_rank, launch.rank, launch.world) == (1, 3, 1, 4, 6)
    # The step's layout beats the allocation's --ntasks-per-node (sbatch's value, inherited).
    assert detect(srun_env(0, 0, 0, SLURM_NTASKS_PER_NODE="1")).local_world == 3
    uneven = srun_env(0, 0, 1, SLURM_STEP_TASKS_PER_NODE="2,1")
    assert detect(uneven).local_world == 1


def test_srun_with_only_ntasks_per_node() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2"}
    launch = detect(env)
    assert (launch.source, launch.local_rank, launch.local_world, launch.world) == ("srun", 1, 2, 2)
    assert launch.job == "7.3.0"


@pytest.mark.parametrize("step", ["4294967291", "batch", "extern", None])
def test_a_batch_script_or_allocation_shell_is_not_an_srun_step(step: str | None) -> None:
    # sbatch's script sees SLURM_PROCID/LOCALID/NTASKS_PER_NODE too, but no numbered srun step.
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NTASKS_PER_NODE": "8", "SLURM_TASKS_PER_NODE": "8"}
    if step is not None:
        env["SLURM_STEP_ID"] = step
    assert detect(env).source == "none"


def test_torchrun_inside_srun_is_torchrun() -> None:
    env = {**srun_env(0, 0, 0, SLURM_STEP_TASKS_PER_NODE="1"), **torchrun_env(1, local_world=8)}
    launch = detect(env)
    assert (launch.source, launch.local_rank, launch.local_world) == ("torchrun", 1, 8)


def test_tasks_per_node_compact_form() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="tasks per node"):
        parse_tasks_per_node("2(x")


@pytest.mark.parametrize("env, message", [
    (torchrun_env(2), "local rank 2 is outside 0..1"),
    ({**torchrun_env(0), "LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two' is not an integer"),
    (srun_env(0, 0, 2), "SLURM_NODEID=2 but tasks per node"),
    (srun_env(0, 0, 0, SLURM_STEP_TASKS_PER_NODE="x"), "cannot read tasks per node"),
])
def test_inconsistent_launcher_variables_are_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        detect(env)


def test_nproc_per_node_follows_the_launcher_and_a_conflict_is_an_error() -> None:
    shared = detect(torchrun_env(0, local_world=4))
    assert resolve_nproc(shared, None) == 4
    assert resolve_nproc(shared, 4) == 4
    with pytest.raises(ConfigError, match="--nproc-per-node 2 conflicts with the 4 processes torchrun started"):
        resolve_nproc(shared, 2)
    # One launcher process per node (srun --ntasks-per-node=1): the agent spawns the ranks itself.
    single = detect(srun_env(0, 0, 0, SLURM_STEP_TASKS_PER_NODE="1"))
    assert resolve_nproc(single, 8) == 8 and resolve_nproc(single, None) == 1
    assert resolve_nproc(Launch(), None) == 1 and resolve_nproc(Launch(), 3) == 3


def test_scrub_drops_torchruns_whole_job_variables_only() -> None:
    env = {**torchrun_env(1), "PATH": "/bin"}
    scrub_cross_node_env(detect(env), env)
    assert set(env) == {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "PATH"}
    slurm = srun_env(0, 0, 0)
    scrub_cross_node_env(detect(slurm), slurm)
    assert slurm == srun_env(0, 0, 0)


def test_run_dir_is_created_private_and_a_shared_one_is_refused(tmp_path: Path) -> None:
    made = ensure_run_dir(str(tmp_path / "a" / "run"))
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(ConfigError, match="open to other users"):
        ensure_run_dir(str(open_dir))
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(ConfigError, match="not a directory"):
        ensure_run_dir(str(link))


def test_a_run_dirs_missing_parents_are_private_too_and_the_default_one_is_made_private_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ensure_run_dir(str(tmp_path / "p" / "q" / "run"))
    assert all((tmp_path / d).stat().st_mode & 0o777 == 0o700 for d in ("p", "p/q", "p/q/run"))
    # The default run dir is this user's by its name: one an older agent left 0755 is tightened, not refused.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        default = Path(default_run_dir())
        assert default.parent == tmp_path
        default.mkdir(mode=0o755)
        default.chmod(0o755)
        assert ensure_run_dir() == default and default.stat().st_mode & 0o777 == 0o700
    finally:
        tempfile.tempdir = None


def test_a_socket_path_too_long_for_unix_sockets_is_refused() -> None:
    with pytest.raises(ConfigError, match="longer than a Unix socket allows"):
        detect(torchrun_env(0)).socket_path("/tmp/" + "d" * 120)


def _devices(tmp_path: Path, n: int) -> str:
    for i in range(n):
        (tmp_path / f"nvidia{i}").touch()
    (tmp_path / "nvidiactl").touch()  # the driver's control files are not devices
    (tmp_path / "nvidia-uvm").touch()
    return str(tmp_path)


def test_visible_cuda_devices_counts_device_files_narrowed_by_cuda_visible_devices(tmp_path: Path) -> None:
    dev = _devices(tmp_path, 4)
    assert visible_cuda_devices({}, dev) == 4
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "2,3"}, dev) == 2
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": ""}, dev) == 0
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, dev) == 1  # CUDA stops at -1
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, dev) == 4
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "0"}, str(tmp_path / "missing")) == 0


def test_more_spawned_ranks_than_gpus_is_refused_with_the_way_out() -> None:
    check_cuda_ranks(2, 0)  # no GPU: gloo on CPU
    check_cuda_ranks(2, 2)
    with pytest.raises(ConfigError, match=r"2 local ranks but 1 visible CUDA device.*--nproc-per-node 1"):
        check_cuda_ranks(2, 1)
