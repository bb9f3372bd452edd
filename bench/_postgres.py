"""A throwaway PostgreSQL server for tests and benches (initdb in its own temp directory, a free port, removed at the end), and which coordinator leads."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gossamer.node.ports import reserve_port

#: Where Debian's postgresql-NN packages put the server binaries (CI installs one; .ci/run).
_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin")


def find_bin_dir() -> tuple[Path | None, str]:
    """The directory holding initdb and pg_ctl, or None and the reason it was not found."""
    for pattern in _BIN_GLOBS:
        for d in sorted(glob.glob(pattern), reverse=True):  # the newest version first
            if os.access(Path(d) / "initdb", os.X_OK) and os.access(Path(d) / "pg_ctl", os.X_OK):
                return Path(d), ""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent, ""
    return None, f"no PostgreSQL server binaries (initdb, pg_ctl) in {', '.join(_BIN_GLOBS)} or on PATH " \
                 "(Debian: apt-get install postgresql; .ci/run does)"


class PostgresServer:
    """initdb + pg_ctl start in a fresh directory (as the `postgres` user when run as root:
    initdb refuses root); `stop()` stops it at once and removes the directory."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="gossamer-pg-"))
        self.data = self.dir / "data"
        self._hold = reserve_port()  # bound until the server listens on it: nobody else may take it meanwhile
        self.port = int(self._hold.getsockname()[1])
        self._as: list[str] = []
        if os.geteuid() == 0:
            import pwd

            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                pw = pwd.getpwnam("nobody")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", pw.pw_name, "--"]
        self.started = False

    def _run(self, *args: str, timeout: float = 120.0) -> None:
        out = subprocess.run([*self._as, *args], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")

    def start(self) -> PostgresServer:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--no-sync")
        # fsync off: the server itself is never killed here; the coordinators are.
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "server.log"), "-o", opts,
                      "-w", "-t", "60", "start")
        finally:
            self._hold.close()
        self.started = True
        return self

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """A fresh, empty database on this server; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self._hold.close()  # never started: the port goes back
        try:
            if self.started:
                self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop")
                self.started = False
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def leads(address: str) -> bool:
    """Whether the coordinator at `address` (asked alone, no failover logic) reports SERVING: it leads."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
