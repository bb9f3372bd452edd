"""User code shipped with `gossamer submit --workdir DIR`: a module the nodes cannot import trains from the shipped copy."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossamer import Client, Experiment
from gossamer.core.errors import ConfigError
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import write_toml

pytestmark = pytest.mark.timeout(420)

#: A module that exists only in the shipped directory: three Gaussian blobs in the plane, a model,
#: and a train function (AdamW, ctx.prepare, ctx.data, ctx.report).
MYMOD = '''
"""The user's code: shipped, never installed."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from helpers.shapes import HIDDEN


def data():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
    y = torch.randint(0, 3, (1200,), generator=g)
    x = centres[y] + torch.randn(1200, 2, generator=g)
    return TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])


def model():
    return nn.Sequential(nn.Linear(2, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))


def train(ctx):
    net = model()
    net, optimizer = ctx.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95)))
    train_set, eval_set = data()
    for x, y in ctx.data(train_set, batch_size=32):
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ctx.report(loss=loss.item())
    if ctx.is_lead:
        x, y = eval_set.tensors
        with torch.no_grad():
            ctx.report(eval_accuracy=float((net(x).argmax(1) == y).float().mean()))
'''


def _code(root: Path, module: str = MYMOD) -> Path:
    (root / "helpers").mkdir(parents=True)
    (root / "helpers" / "__init__.py").write_text("")
    (root / "helpers" / "shapes.py").write_text("HIDDEN = 16\n")
    (root / "mymod.py").write_text(module)
    return root


def _cli(*args: str, cwd: Path, timeout: float = 360) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gossamer.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "COLUMNS": "400"})


def _cluster_elsewhere(cluster: LocalCluster, elsewhere: Path, monkeypatch: pytest.MonkeyPatch, workers: int) -> Client:
    """A coordinator and 1 + `workers` nodes started in `elsewhere`, where `mymod` does not import."""
    elsewhere.mkdir(exist_ok=True)
    for i in range(1 + workers):
        (elsewhere / f"tmp{i}").mkdir()
    monkeypatch.chdir(elsewhere)  # the cluster's processes start here
    probe = subprocess.run([sys.executable, "-c", "import mymod"], cwd=elsewhere, env=cluster.env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'mymod'" in probe.stderr, probe
    address = cluster.start_coordinator(port=0)
    for i in range(1 + workers):
        # Each node's own run directory (its workdir cache under it): every one fetches the code itself.
        cluster.add_node(f"n{i}", env={"TMPDIR": str(elsewhere / f"tmp{i}")})
    client = Client(address)
    deadline = time.monotonic() + 90
    while sum(x["state"] == "ready" for x in client.nodes()) < 1 + workers:
        assert time.monotonic() < deadline, client.nodes()
        time.sleep(0.2)
    return client


def _evals(client: Client, exp_id: str) -> list[float]:
    return [p["eval_accuracy"] for p in client.job(exp_id).metrics() if "eval_accuracy" in p]


@pytest.mark.parametrize("fields", [
    pytest.param({"model": "mymod:model", "dataset": "mymod:data", "optimizer": "sgd", "lr": 0.1,
                  "eval_every": 100}, id="built-in"),
    pytest.param({"train": "mymod:train"}, id="train-function"),
])
def test_a_module_only_in_the_shipped_directory_trains_on_nodes_that_cannot_import_it(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, object]) -> None:
    code = _code(tmp_path / "code")
    client = _cluster_elsewhere(cluster, tmp_path / "elsewhere", monkeypatch, workers=2)
    spec = write_toml(tmp_path / "exp.toml", name="shipped", mode="async", num_ps_shards=1, ps_backup=False,
                 min_workers=2, max_workers=2, total_steps=300, **fields)
    t0 = time.monotonic()
    out = _cli("submit", str(spec), "--workdir", str(code), "--coordinator", client.address, "--wait", "--quiet",
               cwd=tmp_path / "elsewhere")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "shipped" in out.stderr and "3 files" in out.stderr, out.stderr
    exp_id = out.stdout.splitlines()[0].strip()
    result = client.job(exp_id).wait(timeout=30)
    assert result.status == "completed", result
    assert result.metrics["steps"] >= 300
    assert _evals(client, exp_id)[-1] > 0.9
    # Every role ran the shipped copy: the shard (building the model) and both workers.
    roles = {(r["role"], r["node"]) for r in client.job(exp_id).status()["roles"]}
    assert len(roles) == 3, roles
    digest = client.job(exp_id).spec()["workdir"].removeprefix("sha256:")
    for i in range(3):
        cached = tmp_path / "elsewhere" / f"tmp{i}" / f"gossamer-{os.getuid()}" / "workdirs" / digest
        assert (cached / "helpers" / "shapes.py").read_text() == "HIDDEN = 16\n"
        assert stat.S_IMODE(cached.stat().st_mode) == 0o700
        fetched = [line for line in (cluster.log_dir / f"n{i}.log").read_text().splitlines() if "fetched workdir" in line]
        assert len(fetched) == 1, fetched
        print(fetched[0])
    print(f"shipped and trained in {time.monotonic() - t0:.1f} s: {out.stderr.strip()}")
    client.close()


@pytest.mark.cluster(coordinator_args=["--workdir-max-mib", "1"])
def test_a_directory_over_the_coordinators_cap_is_refused_at_submit_naming_its_size(
        cluster: LocalCluster, tmp_path: Path) -> None:
    code = _code(tmp_path / "code")
    (code / "weights.bin").write_bytes(os.urandom(3 << 19))  # 1.5 MiB that gzip cannot shrink
    spec = write_toml(tmp_path / "exp.toml", name="too-big", model="mymod:model", dataset="mymod:data", total_steps=10)
    address = cluster.start_coordinator(port=0)
    out = _cli("submit", str(spec), "--workdir", str(code), "--coordinator", address, cwd=tmp_path)
    assert out.returncode == 2, out
    assert "workdir" in out.stderr and "1.5 MiB" in out.stderr and "cap of 1.0 MiB" in out.stderr, out.stderr
    with Client(address) as client:
        assert client.experiments() == []
        (code / "weights.bin").unlink()
        job = client.submit(_experiment(spec), workdir=code)  # under the cap once the data is gone
        assert job.spec()["workdir"].startswith("sha256:")


def test_an_import_error_in_the_shipped_module_is_refused_at_submit(cluster: LocalCluster, tmp_path: Path) -> None:
    code = _code(tmp_path / "code", module="import not_a_module_anywhere\n\ndef model():\n    pass\n")
    spec = write_toml(tmp_path / "exp.toml", name="broken", model="mymod:model", dataset="mymod:data", total_steps=10)
    address = cluster.start_coordinator(port=0)
    out = _cli("submit", str(spec), "--workdir", str(code), "--coordinator", address, cwd=tmp_path)
    assert out.returncode == 2, out
    assert "model" in out.stderr and "not_a_module_anywhere" in out.stderr, out.stderr
    with Client(address) as client, pytest.raises(ConfigError, match="not_a_module_anywhere"):
        client.submit(_experiment(spec), workdir=code)
    # The same files fixed are another digest, checked afresh: they import.
    (code / "mymod.py").write_text(MYMOD)
    with Client(address) as client:
        assert client.submit(_experiment(spec), workdir=code).status()["state"] in ("queued", "starting")


def _experiment(path: Path) -> Experiment:
    return Experiment.from_toml(path)
