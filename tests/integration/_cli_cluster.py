"""A local cluster driven through the real CLI, for the tests of a user's own code: nodes, `gossamer ...`, waits."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import ranks_env


def wait_ready(client: Client, n: int, timeout: float = 90) -> None:
    """Until `n` nodes are ready."""
    deadline = time.monotonic() + timeout
    while sum(x["state"] == "ready" for x in client.nodes()) < n:
        assert time.monotonic() < deadline, client.nodes()
        time.sleep(0.2)


def cli(*args: str, timeout: float = 360) -> subprocess.CompletedProcess[str]:
    """`gossamer ARGS` in a subprocess, its output captured (wide, so rich does not wrap it)."""
    return subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "400"})


def spot_cluster(cluster: LocalCluster, workers: int, env: dict[str, str] | None = None) -> tuple[str, Client]:
    """A coordinator, one on-demand node and `workers` spot nodes, all ready; its address and a client."""
    address = cluster.start_coordinator(port=0)
    cluster.add_node("od0", env=env)
    for i in range(workers):
        cluster.add_node(f"spot{i}", spot=True, env=env)
    client = Client(address)
    wait_ready(client, 1 + workers)
    return address, client


def ranks_cluster(cluster: LocalCluster, workers: int, env: dict[str, str] | None = None, *,
                  shard_nodes: int = 1) -> Client:
    """A coordinator, `shard_nodes` on-demand nodes of one rank (the shards') and `workers` spot nodes of two local
    ranks each (gloo), all ready; a client."""
    address = cluster.start_coordinator(port=0)
    for i in range(shard_nodes):
        cluster.add_node(f"od{i}", env=env)
    for i in range(workers):
        cluster.add_node(f"spot{i}", spot=True, nproc_per_node=2, env={**ranks_env(2), **(env or {})})
    client = Client(address)
    wait_ready(client, shard_nodes + workers)
    return client
