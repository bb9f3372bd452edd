"""The core install (no extras) runs a coordinator and nodes and trains a user's model and train function; verbs that need an extra name it.

A fresh virtual environment gets the pinned CPU torch and gossamer without extras, as a user's
`pip install gossamer` would: no numba, scikit-learn or matplotlib. Everything then runs from that
environment's interpreter, with the user's code in a directory of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("numba", "sklearn", "matplotlib")

USER_MODULE = '''
"""A user's regression: y = x @ w + noise, generated from a seed (no data set to fetch)."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

W = torch.arange(1.0, 9.0) / 8


def model() -> nn.Module:
    return nn.Linear(8, 1, bias=False)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    y = x @ W + 0.01 * torch.randn(2048, generator=g)
    return TensorDataset(x[:1792], y[:1792, None]), TensorDataset(x[1792:], y[1792:, None])


def loss(out, y):
    return ((out - y) ** 2).mean()


def train(ctx):
    """The same regression as the user's own loop: Adam with its betas, a train function."""
    net = model()
    net, optimizer = ctx.prepare(net, torch.optim.Adam(net.parameters(), lr=0.02, betas=(0.9, 0.95)))
    train_set, eval_set = data()
    for x, y in ctx.data(train_set, batch_size=32):
        optimizer.zero_grad()
        error = loss(net(x), y)
        error.backward()
        optimizer.step()
        ctx.report(loss=error.item())
    if ctx.is_lead:
        x, y = eval_set[:]
        ctx.report(eval_loss=loss(net(x), y).item())
'''

RUN = '''
import json
from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster

with LocalCluster(stop_grace_s=0) as cluster:
    address = cluster.start_coordinator(port=0)
    cluster.add_node("od0")
    cluster.add_node("spot0", spot=True)
    cluster.wait_joined("od0", "spot0", timeout=120)
    client = Client(address)
    job = client.submit({"name": "core", "mode": "async", "model": "usermodel:model", "dataset": "usermodel:data",
                         "loss": "usermodel:loss", "optimizer": "sgd", "lr": 0.05, "batch_size": 32,
                         "num_ps_shards": 1, "ps_backup": False, "min_workers": 1, "max_workers": 1,
                         "total_steps": 300, "eval_every": 100})
    result = job.wait(timeout=300)
    own = client.submit({"name": "core-train", "mode": "async", "train": "usermodel:train", "num_ps_shards": 1,
                         "ps_backup": False, "min_workers": 1, "max_workers": 1, "total_steps": 300})
    trained = own.wait(timeout=300)
    evals = [p["eval_loss"] for p in own.metrics() if "eval_loss" in p]
    print(json.dumps({"status": result.status, "metrics": result.metrics, "train_status": trained.status,
                      "train_eval_loss": evals[-1] if evals else None}))
    client.close()
'''


@pytest.fixture(scope="module")
def core_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment holding torch and gossamer's core install only; its bin directory."""
    where = tmp_path_factory.mktemp("core-venv")
    venv.EnvBuilder(with_pip=True).create(where)
    bin_dir = where / "bin"
    # From a copy of the source: a build in the tree would leave build/ and egg-info in it.
    source = tmp_path_factory.mktemp("core-source")
    shutil.copytree(ROOT / "gossamer", source / "gossamer", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # The pinned CPU build (from local disk here), then gossamer without extras.
    out = subprocess.run([str(bin_dir / "pip"), "install", "-q", "--disable-pip-version-check", "torch==2.13.0",
                          str(source)], capture_output=True, text=True, timeout=480)
    if out.returncode != 0 and "torch==2.13.0" in out.stderr and "No matching distribution" in out.stderr:
        pytest.skip(f"the pinned CPU torch cannot be installed here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return bin_dir


def _env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, "PYTHONPATH": str(cwd), "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}


def test_core_install_has_none_of_the_extras(core_env: Path) -> None:
    probe = "import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) is not None for m in %r}))"
    out = subprocess.run([str(core_env / "python"), "-c", probe % (EXTRAS,)], capture_output=True, text=True,
                         timeout=60, check=True)
    assert json.loads(out.stdout) == dict.fromkeys(EXTRAS, False)


def test_core_install_runs_a_coordinator_and_nodes_and_trains_a_users_model_and_train_function(
        core_env: Path, tmp_path: Path) -> None:
    (tmp_path / "usermodel.py").write_text(USER_MODULE)
    out = subprocess.run([str(core_env / "python"), "-c", RUN], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed", result
    # Mean squared error from |w|^2 (about 2.6) at the start down to near the noise (1e-4).
    assert result["metrics"]["eval_loss"] < 0.01, result
    # The user's own loop (a train function) learns the same regression on the same core install.
    assert result["train_status"] == "completed" and result["train_eval_loss"] < 0.01, result
    # Imported from the new environment, not this tree: that install is what ran.
    where = subprocess.run([str(core_env / "python"), "-c", "import gossamer; print(gossamer.__file__)"],
                           cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=60, check=True)
    assert Path(where.stdout.strip()).is_relative_to(core_env.parent), where.stdout


@pytest.mark.parametrize(("argv", "extra"), [(["plot", "no-such-id", "-c", "127.0.0.1:1"], "plot"),
                                             (["demo"], "examples")])
def test_a_verb_that_needs_an_extra_names_it(core_env: Path, tmp_path: Path, argv: list[str], extra: str) -> None:
    out = subprocess.run([str(core_env / "gossamer"), *argv], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0, out.stdout + out.stderr
    assert f"pip install 'gossamer[{extra}]'" in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_digits_data_without_scikit_learn_names_the_extra(core_env: Path, tmp_path: Path) -> None:
    code = "from gossamer.examples import digits; digits.data()"
    out = subprocess.run([str(core_env / "python"), "-c", code], cwd=tmp_path, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "MissingExtraError" in out.stderr, out.stderr
    assert "pip install 'gossamer[examples]'" in out.stderr, out.stderr


if sys.platform != "linux":  # the cluster's process groups and signals are Linux's
    pytestmark.append(pytest.mark.skip(reason="Linux only"))
