"""Shared fixtures: in-process coordinators on free ports, a cluster of real processes, the experiment builder."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench._postgres import PostgresServer, find_bin_dir
from gossamer.core import zygote
from gossamer.core.experiment import Experiment
from gossamer.node.warm import start_shared
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import (
    CLUSTER_DEFAULTS,
    InProcessCoordinator,
    MakeCluster,
    StartCoordinator,
    experiment,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster(**kw): LocalCluster keyword arguments of the `cluster` fixture")


@pytest.fixture(scope="session", autouse=True)
def _shared_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every node a test starts in this session forks its role server from one warm interpreter.

    A node's own fork server imports torch and the role code: about 4 s of CPU, for each of the
    hundreds of nodes the suite starts (most of a cluster test's CPU). GOSSAMER_ZYGOTE=0 turns it off.
    """
    if os.environ.get(zygote.ENV) == "0":
        os.environ.pop(zygote.ENV)
        yield
        return
    proc, path = start_shared(tmp_path_factory.mktemp("zygote"), wait=False)
    os.environ[zygote.ENV] = path
    try:
        yield
    finally:
        os.environ.pop(zygote.ENV, None)
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def start_coordinator(tmp_path: Path) -> Iterator[StartCoordinator]:
    """Start an in-process coordinator: `(state_dir=None, *, http=False, **CoordinatorConfig fields)`.

    Heartbeats every 0.2 s and 1 s leases unless told; a fresh state dir unless one is given
    (give the same one to restart on it). Every one started is closed after the test.
    """
    started: list[InProcessCoordinator] = []

    def start(state_dir: Path | None = None, **kw: Any) -> InProcessCoordinator:
        c = InProcessCoordinator(state_dir or tmp_path / f"state{len(started) or ''}",
                                 **{"heartbeat_interval_s": 0.2, "lease_timeout_s": 1.0, **kw})
        started.append(c)
        return c

    yield start
    for c in reversed(started):
        c.close()


@pytest.fixture
def coordinator(start_coordinator: StartCoordinator) -> InProcessCoordinator:
    """An in-process coordinator with the defaults of `start_coordinator`."""
    return start_coordinator()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    """A LocalCluster of real processes: `(**LocalCluster keywords)` over CLUSTER_DEFAULTS.

    Nothing is started until the test starts it; after the test every process each cluster
    started is stopped, then killed by process group, with timeouts (LocalCluster.close).
    """
    made: list[LocalCluster] = []

    def make(**kw: Any) -> LocalCluster:
        c = LocalCluster(kw.pop("state_dir", None) or tmp_path / f"cluster{len(made) or ''}", **{**CLUSTER_DEFAULTS, **kw})
        made.append(c)
        return c

    yield make
    for c in reversed(made):
        c.close()


@pytest.fixture
def cluster(request: pytest.FixtureRequest, make_cluster: MakeCluster) -> LocalCluster:
    """A LocalCluster; a test (or module) marked `@pytest.mark.cluster(**kw)` gets those LocalCluster keywords."""
    marker = request.node.get_closest_marker("cluster")
    return make_cluster(**(marker.kwargs if marker else {}))


@pytest.fixture
def make_experiment() -> Callable[..., Experiment]:
    """The experiment builder (tests._fixtures.experiment) as a fixture: `(*bases, **overrides)`."""
    return experiment


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (skipped with the reason where none is installed)."""
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed: pip install 'gossamer[postgres]'")
    bin_dir, why = find_bin_dir()
    if bin_dir is None:
        pytest.skip(why)
    server = PostgresServer(bin_dir)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a fresh, empty database on the session's PostgreSQL server."""
    return postgres_server.new_database()
