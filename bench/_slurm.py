"""A private Slurm cluster on one machine: munged, slurmctld and one slurmd per network-namespace host, all torn down at the end.

    with SlurmCluster(SlurmConfig(nodes=3), tmp_path / "slurm") as slurm:   # root, slurm-wlm, munge
        job = slurm.sbatch(["--nodes=3", "job.sh"], cwd=tmp_path)
        slurm.wait_state(job, {"COMPLETED"}, timeout=120)

Layout (bench._netns builds the hosts; nothing runs in the root namespace but munged):

    ctl      host 0: slurmctld (SlurmctldHost=ctl), and where `command`/`sbatch` run, like a login node
    node<i>  host i (1..nodes): one slurmd, started as `slurmd -N node<i>`

Each host is a network namespace with its own address, entered with `nsenter --net` plus a
mount and a UTS namespace of its own: hostname ctl, node1, ... (slurmctld refuses to start on
a host whose name is not SlurmctldHost; a job sees its node's name, as on a real node), and a
hosts file from the private directory bind-mounted over /etc/hosts, so that every host
resolves every other by name, as on a cluster with DNS. Not `ip netns exec`: it remounts /sys
for the namespace, which hides /sys/fs/cgroup, and slurmd does not start without a cgroup
file system to look at (22.05 loads its cgroup plugin even with proctrack/linuxproc and
task/none). munged listens on a socket in the private directory (AuthInfo=socket=...: the
machine's own munged, if any, is not used); slurm.conf, the controller's state, the slurmds'
spool directories, pid and log files all lie under the private directory too. `close()` stops
the daemons, kills whatever the jobs left inside the namespaces and deletes the namespaces.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench._netns import Topology
from bench._netns import unavailable_reason as netns_unavailable_reason

#: The programs a cluster needs: Debian's slurm-wlm (slurmctld, slurmd, the client commands) and munge.
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel", "srun")
CONTROLLER = "ctl"
#: Job states after which a job runs no more (squeue/scontrol names).
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE"})


class SlurmUnavailable(RuntimeError):
    """Slurm or munge is missing, or the daemons did not come up: the caller cannot have a cluster here."""


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here (None when it can)."""
    why = netns_unavailable_reason()
    if why:
        return why
    missing = [p for p in PROGRAMS if shutil.which(p, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge; .ci/run does)"
    return None


@dataclass(frozen=True, kw_only=True)
class Partition:
    """One PartitionName line: every node of the cluster, its priority tier and what preemption does to its jobs."""

    name: str
    priority_tier: int = 1
    #: OFF: its jobs are never preempted; REQUEUE or CANCEL: what a higher tier does to them.
    preempt_mode: str = "OFF"
    #: Seconds between the preemption's SIGTERM and the end of the job.
    grace_time_s: int = 0
    default: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_-]*", self.name):
            raise ValueError(f"partition name {self.name!r}: lower-case letters, digits, - and _")
        if self.preempt_mode not in ("OFF", "REQUEUE", "CANCEL"):
            raise ValueError(f"preempt_mode {self.preempt_mode!r}: OFF, REQUEUE or CANCEL")
        if self.grace_time_s < 0:
            raise ValueError("grace_time_s must be >= 0")

    def line(self) -> str:
        return (f"PartitionName={self.name} Nodes=ALL Default={'YES' if self.default else 'NO'} MaxTime=INFINITE "
                f"State=UP PriorityTier={self.priority_tier} PreemptMode={self.preempt_mode} "
                f"GraceTime={self.grace_time_s}")


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """The cluster: its nodes, partitions and the slurm.conf settings a test varies."""

    nodes: int = 2
    partitions: tuple[Partition, ...] = (Partition(name="debug", default=True),)
    #: preempt/none, or preempt/partition_prio: a job in a higher PriorityTier preempts lower ones.
    preempt_type: str = "preempt/none"
    #: Seconds between a job's end (SIGTERM) and SIGKILL of what is left of it.
    kill_wait_s: int = 30
    #: Extra slurm.conf lines, appended as they are.
    extra: tuple[str, ...] = ()
    #: Seconds the daemons get to come up (all nodes idle).
    start_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ValueError("nodes must be in 1..64")
        if not self.partitions or sum(p.default for p in self.partitions) != 1:
            raise ValueError("partitions: at least one, exactly one of them the default")
        if self.preempt_type not in ("preempt/none", "preempt/partition_prio"):
            raise ValueError(f"preempt_type {self.preempt_type!r}: preempt/none or preempt/partition_prio")


def _free_port() -> int:
    # Free on this machine; the namespaces start empty, so it is free on every host there too.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SlurmCluster:
    """munged + slurmctld + `config.nodes` slurmds in `directory` (created; see the module doc)."""

    config: SlurmConfig
    directory: Path
    net: Topology = field(init=False)
    node_names: list[str] = field(init=False)
    conf: Path = field(init=False)
    _munged: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _daemons: list[subprocess.Popen[bytes]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).resolve()
        # Unix sockets (munged's; slurmstepd's, in the spool directory) live in a short directory of
        # their own: a socket path has at most 108 bytes, and pytest's tmp_path under xdist passes it.
        self.sockets = Path(tempfile.mkdtemp(prefix="gsl-", dir="/tmp"))
        self.node_names = [f"node{i}" for i in range(1, self.config.nodes + 1)]
        self.conf = self.directory / "slurm.conf"
        self.net = Topology(self.config.nodes + 1)

    # --- paths and environment ----------------------------------------------------------
    @property
    def munge_socket(self) -> Path:
        return self.sockets / "munge.sock"

    @property
    def logs(self) -> Path:
        return self.directory / "log"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment with SLURM_CONF pointing at this cluster (sbatch passes it on to jobs)."""
        path = os.environ.get("PATH", "/usr/bin:/bin")
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{path}:/usr/sbin:/sbin", **(extra or {})}

    def address(self, name: str) -> str:
        """The address of host `name` (ctl, node1, ...)."""
        return self.net.hosts[0 if name == CONTROLLER else self.node_names.index(name) + 1].addr

    # --- bringing up ----------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        why = unavailable_reason()
        if why:
            raise SlurmUnavailable(why)
        for d in ("munge", "log", "run", "ctld"):
            (self.directory / d).mkdir(parents=True, exist_ok=True)
        self.sockets.chmod(0o755)
        (self.sockets / "spool").mkdir(exist_ok=True)
        self.net.open()
        try:
            self._write_hosts()
            self._start_munged()
            self._write_conf()
            self._daemon(CONTROLLER, ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._wait_controller()
            for name in self.node_names:
                (self.sockets / "spool" / name).mkdir(exist_ok=True)
                self._daemon(name, ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._wait_idle()
        except BaseException:
            self.close()
            raise
        return self

    def host_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on host `name` (ctl, node1, ...): its network, its hostname, its /etc/hosts."""
        ns = self.net.hosts[0 if name == CONTROLLER else self.node_names.index(name) + 1].ns
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"', name,
                str(self.directory / "hosts"), *argv]

    def _daemon(self, name: str, argv: Sequence[str]) -> None:
        with open(self.logs / f"{argv[0]}-{name}.out", "ab") as log:
            self._daemons.append(subprocess.Popen(self.host_argv(name, argv), stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True))

    def _write_hosts(self) -> None:
        names = [CONTROLLER, *self.node_names]
        lines = ["127.0.0.1 localhost", *(f"{h.addr} {n}" for h, n in zip(self.net.hosts, names, strict=True))]
        (self.directory / "hosts").write_text("\n".join(lines) + "\n")

    def _start_munged(self) -> None:
        d = self.directory / "munge"
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        d.chmod(0o755)
        # --force: munged wants every directory above its socket searchable by all, which a
        # private temporary directory is not; the socket is only ever used by this cluster.
        argv = ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}", "--num-threads=4"]
        with open(self.logs / "munged.log", "ab") as log:
            self._munged = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged did not start: {self._log('munged.log')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        c, d = self.config, self.directory
        cpus = os.cpu_count() or 1
        lines = [
            "ClusterName=gossamer",
            f"SlurmctldHost={CONTROLLER}({self.net.hosts[0].addr})",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmdSpoolDir={self.sockets / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd-%n.log'}",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # No cgroups: the hosts share one kernel and one cgroup tree; process trees are tracked by parentage.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            # Whole nodes, as a gossamer job takes them.
            "SelectType=select/linear",
            "SchedulerType=sched/builtin",
            "ReturnToService=2",
            # The hosts share this machine's CPUs: the node lines, not the hardware, say what a node has.
            "SlurmdParameters=config_overrides",
            f"KillWait={c.kill_wait_s}",
            "MinJobAge=600",
            f"PreemptType={c.preempt_type}",
            f"PreemptMode={'REQUEUE' if c.preempt_type != 'preempt/none' else 'OFF'}",
            *(f"NodeName={n} NodeAddr={h.addr} CPUs={cpus} State=UNKNOWN"
              for n, h in zip(self.node_names, self.net.hosts[1:], strict=True)),
            *(p.line() for p in c.partitions),
            *c.extra,
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _wait_controller(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            p = self.command(["scontrol", "ping"], timeout=15, check=False)
            if "UP" in p.stdout:
                return
            if self._daemons[0].poll() is not None or time.monotonic() > deadline:
                raise SlurmUnavailable(f"slurmctld did not answer: {p.stdout}{p.stderr}\n"
                                       f"{self._log('slurmctld.log')}{self._log('slurmctld-ctl.out')}")
            time.sleep(0.2)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            states = self.node_states()
            if all(s.rstrip("*").upper() == "IDLE" for s in states.values()) and len(states) == len(self.node_names):
                return
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(self._log(f"slurmd-{n}.log") + self._log(f"slurmd-{n}.out") for n in self.node_names)
                raise SlurmUnavailable(f"the nodes did not all come up idle: {states}\n{logs}")
            time.sleep(0.2)

    def _log(self, name: str, tail: int = 3000) -> str:
        path = self.logs / name
        return f"--- {name}:\n{path.read_text(errors='replace')[-tail:]}\n" if path.exists() else ""

    # --- using it ------------------------------------------------------------------------
    def command(self, argv: Sequence[str], *, timeout: float = 30.0, check: bool = True,
                env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
        """Run a client command (sbatch, squeue, scontrol, ...) on the controller host, as a user on a login node would."""
        p = subprocess.run(self.host_argv(CONTROLLER, argv), capture_output=True, text=True, timeout=timeout,
                           env=self.env(env), cwd=cwd, stdin=subprocess.DEVNULL, check=False)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
        return p

    def on_node(self, name: str, argv: Sequence[str], *, timeout: float = 30.0,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run `argv` on host `name`."""
        return subprocess.run(self.host_argv(name, argv), capture_output=True, text=True, timeout=timeout, env=self.env(env),
                              stdin=subprocess.DEVNULL, check=False)

    def sbatch(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None) -> str:
        """Submit a batch job; its id."""
        p = self.command(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        return p.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` of `job_id` as KEY -> VALUE (JobState, NodeList, Restarts, Reason, ...)."""
        p = self.command(["scontrol", "-o", "show", "job", job_id])
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", p.stdout))

    def node_states(self) -> dict[str, str]:
        p = self.command(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        return dict(line.split() for line in p.stdout.splitlines() if len(line.split()) == 2)

    def wait_state(self, job_id: str, states: set[str] | frozenset[str], timeout: float) -> dict[str, str]:
        """Poll until the job is in one of `states`; its `job` record. TimeoutError with the logs otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not {sorted(states)} after {timeout:.0f} s: {info}\n"
                                   f"{self._log('slurmctld.log')}")
            time.sleep(0.2)

    def controller_log(self) -> str:
        return (self.logs / "slurmctld.log").read_text(errors="replace") if (self.logs / "slurmctld.log").exists() \
            else ""

    # --- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the daemons, kill what the jobs left, delete the namespaces."""
        try:
            Topology.stop_all(self._daemons, signal.SIGTERM, timeout=10.0)
            self.net.close()  # also SIGKILLs whatever jobs left running inside the hosts
        finally:
            if self._munged is not None:
                Topology.stop(self._munged, signal.SIGTERM, timeout=5.0)
            shutil.rmtree(self.sockets, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
