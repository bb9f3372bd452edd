"""The CPU image built from deploy/docker as docs/deploy.md says, run as a coordinator and two nodes that train digits."""

from __future__ import annotations

import json
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import _images
from tests.integration._images import docker

pytestmark = pytest.mark.timeout(_images.BUILD_TIMEOUT_S + 900)

EXPERIMENT = (
    'name = "digits-docker"\nmodel = "gossamer.examples.digits:mlp"\ndataset = "gossamer.examples.digits:data"\n'
    'mode = "async"\nlr = 0.05\nmomentum = 0.5\nbatch_size = 32\nnum_ps_shards = 1\nmin_workers = 1\n'
    # Two nodes: one hosts the shard, the other trains; a backup would need a third.
    'max_workers = 1\nps_backup = false\ntotal_steps = 300\neval_every = 100\ncheckpoint_every = 100\nseed = 0\n'
)
# docs/deploy.md's user-code recipe: FROM gossamer's image, add your package (here the digits data's scikit-learn).
USER_DOCKERFILE = """FROM {base}
USER root
RUN pip install "scikit-learn>=1.3"
COPY digits.toml /home/gossamer/digits.toml
USER 10001:10001
"""
STATE = "/var/lib/gossamer"
CLIENT = f"{STATE}/secure/client"


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    tag = f"gossamer-test-{secrets.token_hex(4)}"
    try:
        _images.build_cpu_image(f"{tag}:cpu")
    except _images.Unavailable as e:
        pytest.skip(f"the image cannot be built here: {e}")
    try:
        with tempfile.TemporaryDirectory(prefix="gossamer-user-image-") as ctx:
            (Path(ctx) / "Dockerfile").write_text(USER_DOCKERFILE.format(base=f"{tag}:cpu"))
            (Path(ctx) / "digits.toml").write_text(EXPERIMENT)
            docker("build", "--network", "host", "-t", f"{tag}:user", ctx, timeout=900)
        yield f"{tag}:user"
    finally:
        docker("image", "rm", "-f", f"{tag}:user", f"{tag}:cpu", check=False)


class Cluster:
    """Containers on one bridge network, all removed at the end; the state volume is shared (like Slurm's SHARED_DIR)."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.id = secrets.token_hex(4)
        self.network = f"gossamer-test-{self.id}"
        self.volume = f"gossamer-test-state-{self.id}"
        self.containers: list[str] = []
        docker("network", "create", "--driver", "bridge", self.network)
        docker("volume", "create", self.volume)

    def start(self, name: str, *argv: str) -> str:
        full = f"{name}-{self.id}"
        self.containers.append(full)
        docker("run", "-d", "--name", full, "--network", self.network, "--network-alias", name,
               "-v", f"{self.volume}:{STATE}", self.image, *argv)
        return full

    def run(self, *argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return docker("run", "--rm", "--network", self.network, "-v", f"{self.volume}:{STATE}", self.image, *argv,
                      timeout=timeout, check=False)

    def logs(self) -> str:
        return "\n".join(f"--- {c}\n{docker('logs', '--tail', '40', c, check=False).stderr}" for c in self.containers)

    def close(self) -> None:
        for c in self.containers:
            docker("rm", "-f", c, check=False)
        docker("network", "rm", self.network, check=False)
        docker("volume", "rm", "-f", self.volume, check=False)


@pytest.fixture
def cluster(image: str) -> Iterator[Cluster]:
    c = Cluster(image)
    try:
        yield c
    finally:
        c.close()


def wait_serving(cluster: Cluster, container: str, deadline_s: float) -> None:
    """Until the coordinator answers the readiness probe's own call (the Kubernetes manifest's exec probe)."""
    until = time.monotonic() + deadline_s
    while True:
        probe = docker("exec", container, "gossamer", "nodes", "--json", "--coordinator=127.0.0.1:7070",
                       "--connect-timeout=5", f"--secure={CLIENT}", timeout=60, check=False)
        if probe.returncode == 0:
            return
        state = docker("inspect", "-f", "{{.State.Running}}", container, check=False).stdout.strip()
        assert state == "true" and time.monotonic() < until, f"coordinator not serving: {probe.stderr}\n{cluster.logs()}"
        time.sleep(1)


def test_cpu_image_coordinator_and_two_nodes_train_digits_to_completion(cluster: Cluster) -> None:
    co = cluster.start("gossamer-coordinator", "coordinator", "serve", "--host", "0.0.0.0", "--port", "7070",
                       "--http-port", "7071", "--http-host", "0.0.0.0", "--state-dir", STATE,
                       "--secure", f"{STATE}/secure", "--san", "gossamer-coordinator")
    wait_serving(cluster, co, deadline_s=180)
    for i in range(2):
        cluster.start(f"node{i}", "worker", "join", "gossamer-coordinator:7070", "--secure", CLIENT,
                      "--nproc-per-node", "1", "--grace", "10")
    submitted = cluster.run("submit", "/home/gossamer/digits.toml", "--coordinator", "gossamer-coordinator:7070",
                            "--secure", CLIENT, "--wait", "--quiet", timeout=900)
    assert submitted.returncode == 0, f"{submitted.stdout}\n{submitted.stderr}\n{cluster.logs()}"
    exp_id = submitted.stdout.split()[0]
    status = cluster.run("status", exp_id, "--json", "--coordinator", "gossamer-coordinator:7070", "--secure", CLIENT,
                         timeout=120)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["state"].lower() == "completed" and st["steps"] == st["total_steps"] == 300, st
