"""`gossamer local up/down/status`: a LocalCluster left running in the background, found again through its directory."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gossamer.core.errors import ConfigError, GossamerError, UnavailableError
from gossamer.tools.local_cluster import LocalCluster

STATE_FILE = "cluster.json"


@dataclass(frozen=True)
class LocalInfo:
    """What `local up` leaves in its directory for `local down`, `submit --local` and the user."""

    address: str
    status_page: str
    state_dir: str
    log_dir: str
    pids: dict[str, int]  # process name -> PID; each leads its own process group
    started_unix: float


def read_info(directory: str | os.PathLike[str]) -> LocalInfo | None:
    """The running local cluster of `directory`, or None when `local up` left none there."""
    path = Path(directory) / STATE_FILE
    try:
        return LocalInfo(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise GossamerError(f"{path} is damaged ({e}); remove it after checking no gossamer process runs") from None


def local_address(directory: str | os.PathLike[str]) -> str:
    """The coordinator address of the local cluster in `directory` (what `--local` means)."""
    info = read_info(directory)
    if info is None:
        raise UnavailableError(f"no local cluster in {directory}: start one with `gossamer local up`")
    return info.address


def up(directory: str | os.PathLike[str], *, nodes: int, spot: int, gpus_per_node: int = 0, http_port: int = 0,
       timeout_s: float = 120.0) -> LocalInfo:
    """Start a coordinator (status page on) and `nodes` agents, `spot` of them spot, in the background.

    Every process runs in its own session, so it outlives this one; on any failure what was
    started is stopped again before the error propagates.
    """
    if nodes < 1:
        raise ConfigError("nodes", f"must be at least 1, got {nodes}")
    if not 0 <= spot <= nodes:
        raise ConfigError("spot", f"must be between 0 and --nodes ({nodes}), got {spot}")
    if gpus_per_node < 0:
        raise ConfigError("gpus_per_node", f"must be 0 (CPU) or more, got {gpus_per_node}")
    root = Path(directory).resolve()
    info = read_info(root)
    if info is not None and alive(info):
        raise GossamerError(f"a local cluster already runs from {root} at {info.address}; "
                            "`gossamer local down` stops it")
    root.mkdir(parents=True, exist_ok=True)
    # The user's own model module sits where they run `local up`: every node can import it.
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    cluster = LocalCluster(root / "state", log_dir=root / "logs", env={"PYTHONPATH": path},
                           coordinator_args=["--http-port", str(http_port)])
    try:
        address = cluster.start_coordinator(port=0)
        names = [f"spot-{i}" if i >= nodes - spot else f"ondemand-{i}" for i in range(nodes)]
        for i, name in enumerate(names):
            env = None
            if gpus_per_node:
                env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i * gpus_per_node + g) for g in range(gpus_per_node))}
            cluster.add_node(name, spot=name.startswith("spot"), nproc_per_node=max(1, gpus_per_node), env=env)
        cluster.wait_joined(*names, timeout=timeout_s, ready=True)
        port = (cluster.state_dir / "http.port").read_text().strip()
        assert cluster.coordinator is not None
        info = LocalInfo(address=address, status_page=f"http://127.0.0.1:{port}/", state_dir=str(cluster.state_dir),
                         log_dir=str(cluster.log_dir), started_unix=time.time(),
                         pids={"coordinator": cluster.coordinator.pid, **{n: p.pid for n, p in cluster.nodes.items()}})
        (root / STATE_FILE).write_text(json.dumps(asdict(info), indent=1))
    except BaseException:
        cluster.stop_grace_s = 0.0
        cluster.close()
        raise
    return info


def _ours(pid: int) -> bool:
    """PID runs gossamer (not some later process that reused the number)."""
    try:
        return b"gossamer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """PIDs of live processes in process group `pgid` (from /proc; zombies excluded)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def alive(info: LocalInfo) -> bool:
    """Any process `local up` started (or any process of their groups) still runs."""
    return any(group_members(pid) for pid in info.pids.values())


def down(directory: str | os.PathLike[str], grace_s: float = 15.0) -> tuple[LocalInfo | None, int]:
    """Stop every process `local up` started in `directory`: SIGTERM, then SIGKILL to their whole groups.

    Nodes first (they leave gracefully within `grace_s`), then the coordinator. Returns the
    cluster found (None: there was none) and how many processes had to be killed.
    """
    root = Path(directory).resolve()
    info = read_info(root)
    if info is None:
        return None, 0
    coordinator = info.pids.get("coordinator")
    nodes = [pid for name, pid in info.pids.items() if name != "coordinator"]
    _signal_all([pid for pid in nodes if _ours(pid)], signal.SIGTERM)
    _wait_gone(nodes, grace_s)
    if coordinator is not None:
        if _ours(coordinator):
            _signal_all([coordinator], signal.SIGTERM)
        _wait_gone([coordinator], 10.0)
    killed = 0
    for pgid in info.pids.values():  # role processes of the nodes, and anything that did not stop
        members = group_members(pgid)
        if members:
            killed += len(members)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 10.0
    while any(group_members(pgid) for pgid in info.pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    (root / STATE_FILE).unlink(missing_ok=True)
    return info, killed


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(pgids: list[int], timeout_s: float) -> None:
    """Wait until nothing runs in the process groups `pgids` (the agents' fork servers included), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(group_members(pgid) for pgid in pgids):
        time.sleep(0.05)
