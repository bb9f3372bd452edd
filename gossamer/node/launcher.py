"""Which launcher (torchrun, srun) started this process, and where a node's local ranks meet its agent."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gossamer.core.errors import ConfigError

log = logging.getLogger(__name__)

#: Slurm's own step ids (batch script, extern, interactive, pending, ...): no srun step runs there.
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0
#: What torchrun sets for a group spanning every node: gossamer's process group is per node, so its
#: role processes never see these (an `env://` init could otherwise join the launcher's group).
_CROSS_NODE_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE")
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


@dataclass(frozen=True, kw_only=True)
class Launch:
    """This process's place in a launcher's job. `source="none"`: started by hand, one process per node.

    `job` is the same string in every local rank of one node of one launch (torchrun: run id,
    master address and port, node rank, restart count; srun: job id, step id, node id) and
    differs between nodes, launches and torchrun restarts.
    """

    source: Literal["torchrun", "srun", "none"] = "none"
    local_rank: int = 0
    local_world: int = 1
    node_rank: int = 0
    rank: int = 0
    world: int = 1
    job: str = ""

    def __post_init__(self) -> None:
        if self.local_world < 1:
            raise ConfigError("launcher", f"{self.source}: local world size must be >= 1, got {self.local_world}")
        if not 0 <= self.local_rank < self.local_world:
            raise ConfigError("launcher", f"{self.source}: local rank {self.local_rank} is outside 0..{self.local_world - 1}")

    @property
    def shared(self) -> bool:
        """Several processes of this launch run on this node and share one node agent."""
        return self.local_world > 1

    def socket_path(self, run_dir: str = "") -> str:
        """The Unix socket where local rank 0's agent listens and the other local ranks attach:
        `<run_dir>/<source>-<16 hex digits of sha256(job)>.sock`, `run_dir` defaulting to
        `default_run_dir()`. Every local rank computes the same path from its own environment."""
        digest = hashlib.sha256(self.job.encode()).hexdigest()[:16]
        path = os.path.join(run_dir or default_run_dir(), f"{self.source}-{digest}.sock")
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise ConfigError("run_dir", f"socket path {path!r} is longer than a Unix socket allows "
                                         f"({_UNIX_PATH_MAX} bytes): choose a shorter --run-dir")
        return path


def default_run_dir() -> str:
    """`$TMPDIR/gossamer-<uid>` (node-local; Slurm's per-job TMPDIR is the same for all of a node's tasks)."""
    return os.path.join(tempfile.gettempdir(), f"gossamer-{os.getuid()}")


def ensure_run_dir(path: str = "") -> Path:
    """Create `path` (mode 0700) or check that it is a directory private to this user; by default
    `default_run_dir()`, which is this user's by its name: one left open to others (older gossamer
    made it 0755 when it wrote its role logs there first) is made 0700 again, with a warning.

    Raises:
        ConfigError: it is a symlink, someone else's, or open to the group or others (anyone who
            can connect to the socket could send the agent's local ranks their work).
    """
    own = not path
    p = Path(path or default_run_dir())
    for missing in [d for d in (*reversed(p.parents), p) if not d.exists()]:
        missing.mkdir(mode=0o700, exist_ok=True)  # `parents=True` would make the missing parents 0755
    st = p.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError("run_dir", f"{p} is not a directory (a symlink?)")
    if st.st_uid != os.getuid():
        raise ConfigError("run_dir", f"{p} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077 and own:
        log.warning("%s was open to other users (mode %o): made 0700", p, st.st_mode & 0o777)
        p.chmod(0o700)
    elif st.st_mode & 0o077:
        raise ConfigError("run_dir", f"{p} is open to other users (mode {st.st_mode & 0o777:o}): chmod 700 it")
    return p


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's compact tasks-per-node list, e.g. `"2(x3),1"` -> `[2, 2, 2, 1]`."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ConfigError("launcher", f"srun: cannot read tasks per node {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _int(env: Mapping[str, str], name: str, source: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ConfigError("launcher", f"{source}: {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError("launcher", f"{source}: {name}={raw!r} is not an integer") from None


def _torchrun(env: Mapping[str, str]) -> Launch:
    node_rank = _int(env, "GROUP_RANK", "torchrun", 0)
    job = "|".join([env.get("TORCHELASTIC_RUN_ID", ""), env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""),
                    str(node_rank), env.get("TORCHELASTIC_RESTART_COUNT", "0")])
    return Launch(source="torchrun", local_rank=_int(env, "LOCAL_RANK", "torchrun"),
                  local_world=_int(env, "LOCAL_WORLD_SIZE", "torchrun"), node_rank=node_rank,
                  rank=_int(env, "RANK", "torchrun", 0), world=_int(env, "WORLD_SIZE", "torchrun", 1), job=job)


def _srun_step(env: Mapping[str, str]) -> int | None:
    """The srun step id, or None outside an srun step (a batch script, salloc's shell, no Slurm)."""
    raw = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if raw is None or "SLURM_LOCALID" not in env:
        return None
    try:
        step = int(raw)
    except ValueError:
        return None  # "batch", "extern": not a step srun started
    return step if step < _SLURM_SPECIAL_STEPS else None


def _srun(env: Mapping[str, str], step: int) -> Launch:
    node = _int(env, "SLURM_NODEID", "srun", 0)
    # The step's own layout first: SLURM_NTASKS_PER_NODE may be the allocation's (sbatch's) value.
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if layout:
        per_node = parse_tasks_per_node(layout)
        if node >= len(per_node):
            raise ConfigError("launcher", f"srun: SLURM_NODEID={node} but tasks per node {layout!r} lists "
                                          f"{len(per_node)} node(s)")
        local_world = per_node[node]
    else:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", "srun", 1)
    return Launch(source="srun", local_rank=_int(env, "SLURM_LOCALID", "srun"), local_world=local_world,
                  node_rank=node, rank=_int(env, "SLURM_PROCID", "srun", 0),
                  world=_int(env, "SLURM_STEP_NUM_TASKS", "srun", _int(env, "SLURM_NTASKS", "srun", 1)),
                  job=f"{env.get('SLURM_JOB_ID', env.get('SLURM_JOBID', ''))}.{step}.{node}")


def detect(env: Mapping[str, str] | None = None) -> Launch:
    """The launcher of this process, from its environment (`os.environ` by default).

    torchrun when LOCAL_RANK and LOCAL_WORLD_SIZE are set (it wins over Slurm: torchrun started
    by srun is the inner launcher); srun when a numbered srun step is (SLURM_STEP_ID and
    SLURM_LOCALID; the local world comes from SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE or
    SLURM_NTASKS_PER_NODE, indexed by SLURM_NODEID); otherwise none.

    Raises:
        ConfigError: a launcher's variables are present but unreadable or inconsistent.
    """
    env = os.environ if env is None else env
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return _torchrun(env)
    step = _srun_step(env)
    if step is not None:
        return _srun(env, step)
    return Launch()


def resolve_nproc(launch: Launch, requested: int | None) -> int:
    """Local ranks per worker: the launcher's processes on this node, or `--nproc-per-node` (default 1).

    With one launcher process per node (srun --ntasks-per-node=1), the agent spawns
    `--nproc-per-node` ranks itself, as without a launcher.

    Raises:
        ConfigError: `requested` disagrees with the launcher's local world size.
    """
    if not launch.shared:
        return 1 if requested is None else requested
    if requested is not None and requested != launch.local_world:
        raise ConfigError("nproc_per_node", f"--nproc-per-node {requested} conflicts with the {launch.local_world} "
                                            f"processes {launch.source} started on this node: leave it out "
                                            f"(or set it to {launch.local_world})")
    return launch.local_world


def visible_cuda_devices(env: Mapping[str, str] | None = None, dev_dir: str = "/dev") -> int:
    """CUDA devices a rank started by this process would see, without importing torch (slow):
    the driver's `nvidiaN` device files, narrowed by CUDA_VISIBLE_DEVICES when it is set."""
    env = os.environ if env is None else env
    try:
        present = len([d for d in os.listdir(dev_dir) if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        present = 0
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None or present == 0:
        return present
    count = 0
    for entry in listed.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):  # CUDA ignores the list from the first invalid entry
            break
        count += 1
    return min(count, present)


def check_cuda_ranks(nproc: int, devices: int) -> None:
    """Refuse more spawned local ranks than visible GPUs: two NCCL ranks on one GPU fail at
    the first collective with a duplicate-device error, far from the cause.

    Raises:
        ConfigError: `nproc` > `devices` > 0.
    """
    if 0 < devices < nproc:
        raise ConfigError("nproc_per_node", f"{nproc} local ranks but {devices} visible CUDA device(s): NCCL needs "
                                            f"one GPU per rank. Use --nproc-per-node {devices}, or train on CPU "
                                            "with gloo by setting CUDA_VISIBLE_DEVICES to an empty string")


def scrub_cross_node_env(launch: Launch, env: MutableMapping[str, str] | None = None) -> None:
    """Drop torchrun's whole-job rank, world size and master from `env` (`os.environ` by default),
    so the role processes this one starts see only their node (LOCAL_RANK stays)."""
    if launch.source != "torchrun":
        return
    env = os.environ if env is None else env
    for name in _CROSS_NODE_VARS:
        env.pop(name, None)
