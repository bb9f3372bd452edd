"""A whole cluster as local processes (coordinator + node agents on free loopback ports), for demo and tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gossamer.core.errors import UnavailableError

if TYPE_CHECKING:
    from gossamer.security.channel import ChannelSecurity
    from gossamer.tools.client import Client


class LocalCluster:
    """Starts real processes; `close()` (or the context manager) stops every one it started, by PID.

    Security (docs/security.md): `secure=DIR` runs the coordinator with `--secure DIR` (mutual
    TLS and a token, created in DIR if missing) and every node with `--secure DIR/client`.
    `coordinator_args` and `node_args` add any other flags (e.g. `--tls-cert ... --token-file ...`);
    `client_args` are the flags a CLI client then needs, and `client()` a matching `Client`.
    `stop_grace_s`: how long `close()` lets the nodes leave gracefully (0: SIGKILL at once, as
    tests do once they have what they assert on).
    """

    def __init__(self, state_dir: str | os.PathLike[str] | None = None, *, heartbeat_interval: float = 0.5,
                 lease_timeout: float = 5.0, log_dir: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None, secure: str | os.PathLike[str] | None = None,
                 coordinator_args: list[str] | None = None, node_args: list[str] | None = None,
                 client_args: list[str] | None = None, stop_grace_s: float = 15.0) -> None:
        self._tmp = None if state_dir else tempfile.TemporaryDirectory(prefix="gossamer-")
        self.state_dir = Path(state_dir or self._tmp.name)  # type: ignore[union-attr]
        self.log_dir = Path(log_dir or self.state_dir / "logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.heartbeat_interval = heartbeat_interval
        self.stop_grace_s = stop_grace_s
        self.lease_timeout = lease_timeout
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        #: Coordinators sharing one PostgreSQL state (`start_replicas`), by name, and their ports.
        self.replicas: dict[str, subprocess.Popen[bytes]] = {}
        self.replica_ports: dict[str, int] = {}
        self._started: list[subprocess.Popen[bytes]] = []  # every process, stopped or not, for close()
        self.secure = None if secure is None else Path(secure).resolve()
        self.coordinator_args = [*(["--secure", str(self.secure)] if self.secure else []), *(coordinator_args or [])]
        self.node_args = [*(["--secure", str(self.secure / "client")] if self.secure else []), *(node_args or [])]
        self.client_args = [*(["--secure", str(self.secure / "client")] if self.secure else []),
                            *(client_args if client_args is not None else node_args or [])]

    @property
    def address(self) -> str:
        """The coordinator's HOST:PORT; with replicas (`start_replicas`), every one's, comma-separated."""
        if self.replicas:
            return ",".join(f"127.0.0.1:{p}" for p in self.replica_ports.values())
        return f"127.0.0.1:{self.port}"

    @property
    def security(self) -> ChannelSecurity | None:
        """What a client needs to reach this cluster's coordinator (None: plaintext, no token)."""
        import argparse

        from gossamer.security.channel import ChannelSecurity

        p = argparse.ArgumentParser(add_help=False)
        for flag in ("--secure", "--tls-ca", "--tls-cert", "--tls-key", "--tls-server-name", "--token-file"):
            p.add_argument(flag)
        args, _ = p.parse_known_args(self.client_args)
        return ChannelSecurity.from_flags(**vars(args))

    def client(self, timeout: float = 30.0) -> Client:
        """A `Client` of this cluster's coordinator, with its security settings."""
        from gossamer.tools.client import Client

        return Client.secured(self.address, self.security, timeout=timeout)

    def _spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / log_name, "ab")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gossamer.tools.cli", *args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})}, process_group=0,
            )
        finally:
            log.close()
        # Its own process group (its PID is the group's id), in this session: a shared zygote
        # (gossamer.core.zygote) started here may place the node's role server in that group.
        self._started.append(proc)
        return proc

    def start_coordinator(self, port: int | None = None, timeout: float = 120.0) -> str:
        """Start (or restart, on the same state dir and port) the coordinator; returns HOST:PORT."""
        port = self.port if port is None else port
        self.coordinator, self.port = self._serve("coordinator", self.state_dir, port, [], timeout)
        return self.address

    def start_replicas(self, state: str, count: int = 2, timeout: float = 120.0) -> str:
        """Start `count` coordinators on one PostgreSQL `state` (docs/ha.md), each on its own port,
        state dir (`STATE_DIR/cN`) and log (`cN.log`); the first to take the lock leads. Returns
        every address, comma-separated (`address`), as nodes and clients are given it."""
        for _ in range(count):
            name = f"c{len(self.replicas)}"
            self.replicas[name], self.replica_ports[name] = self._serve(
                name, self.state_dir / name, 0, ["--state", state], timeout)
        return self.address

    def _serve(self, name: str, state_dir: Path, port: int, args: list[str],
               timeout: float) -> tuple[subprocess.Popen[bytes], int]:
        """Spawn `coordinator serve` and wait for its ready file; the process and its bound port."""
        state_dir.mkdir(parents=True, exist_ok=True)
        ready = state_dir / "coordinator.port"
        ready.unlink(missing_ok=True)
        proc = self._spawn(
            ["coordinator", "serve", "--port", str(port), "--state-dir", str(state_dir),
             "--heartbeat-interval", str(self.heartbeat_interval), "--lease-timeout", str(self.lease_timeout),
             "--ready-file", str(ready), *args, *self.coordinator_args],
            f"{name}.log",
        )
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise UnavailableError(f"coordinator did not start; see {self.log_dir / name}.log")
            time.sleep(0.05)
        return proc, int(ready.read_text())

    def add_node(self, name: str, *, spot: bool = False, nproc_per_node: int = 1,
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        args = ["worker", "join", self.address, "--name", name, "--nproc-per-node", str(nproc_per_node),
                *self.node_args]
        if spot:
            args.append("--spot")
        proc = self._spawn(args, f"{name}.log", env)
        self.nodes[name] = proc
        return proc

    def wait_joined(self, *names: str, timeout: float = 60.0, ready: bool = False) -> None:
        """Wait until the coordinator lists a node by each of `names` (UnavailableError after `timeout` s).

        `ready`: listed as ready (a state dir of an earlier cluster may still list its nodes by those names).
        """
        client = self.client()
        try:
            deadline = time.monotonic() + timeout
            while not set(names) <= {n["name"] for n in client.nodes() if not ready or n["state"] == "ready"}:
                for name in names:
                    proc = self.nodes.get(name)
                    if proc is not None and proc.poll() is not None:
                        raise UnavailableError(f"node {name} exited ({proc.returncode}); see {self.log_dir / name}.log")
                if time.monotonic() > deadline:
                    raise UnavailableError(f"nodes {sorted(names)} did not join within {timeout:g} s; "
                                           f"see the logs in {self.log_dir}")
                time.sleep(0.05)
        finally:
            client.close()

    def kill_node(self, name: str) -> None:
        """SIGKILL a node's agent and every role process it started (a vanished spot machine)."""
        proc = self.nodes.pop(name)
        _kill_group(proc)
        proc.wait(timeout=10)

    def kill_coordinator(self, name: str = "") -> None:
        """SIGKILL the coordinator, or the replica `name` (and nothing else)."""
        proc = self.replicas[name] if name else self.coordinator
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def stop_node(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        proc = self.nodes.pop(name)
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
        return proc.returncode

    def close(self) -> None:
        """Stop every process this cluster started, by PID; may be called more than once.

        SIGTERM to every node at once (none if `stop_grace_s` is 0), then to the coordinator;
        what has not exited `stop_grace_s` s later (10 s for the coordinator), and anything left
        in the process group of any process it ever started (role processes of a node stopped
        or killed earlier), is SIGKILLed and reaped.
        """
        nodes, self.nodes = list(self.nodes.values()), {}
        for proc in nodes:
            if self.stop_grace_s <= 0:
                _kill_group(proc)
            elif proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for proc in nodes:
            _wait(proc, deadline - time.monotonic())
        coordinators = [p for p in (self.coordinator, *self.replicas.values()) if p is not None and p.poll() is None]
        for proc in coordinators:
            proc.send_signal(signal.SIGTERM)
        for proc in coordinators:
            _wait(proc, 10.0)
        started, self._started = self._started, []
        for proc in started:
            _kill_group(proc)
            _wait(proc, 10.0)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s process group (it was started in a group of its own: its PID is the group's id)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait up to `timeout` s (at least a moment) for `proc` to exit; SIGKILL it if it has not."""
    try:
        proc.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
