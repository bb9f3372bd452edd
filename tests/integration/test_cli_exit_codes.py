"""The exit codes of the installed `gossamer` command, each through a real process: 0 done, 1 failed, 2 usage, 3 unreachable."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gossamer
from tests._fixtures import DIGITS, InProcessCoordinator, StartCoordinator
from tests.integration.test_experiment_deadlines import Nodes

pytestmark = pytest.mark.timeout(120)
GOSSAMER = Path(sys.executable).parent / "gossamer"  # the console script pip installed
DIGITS_TOML = Path(__file__).resolve().parents[2] / "examples" / "digits.toml"


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSAMER_")}
    return subprocess.run([str(GOSSAMER), *argv], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound here and never listened on: a connection to it is refused, and no one else can take it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def live(start_coordinator: StartCoordinator) -> InProcessCoordinator:
    return start_coordinator(check_imports=False)


def test_version_prints_the_package_version_and_exits_0() -> None:
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"gossamer {gossamer.__version__}", out.stdout + out.stderr


def test_the_exit_codes_are_listed_in_help() -> None:
    out = _run("--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for line in ("0 done", "1 the command or the run failed", "2 usage error", "3 the coordinator did not answer"):
        assert line in text, out.stdout


def test_a_coordinator_refusing_the_connection_exits_3(closed_port: int) -> None:
    out = _run("status", "--coordinator", f"127.0.0.1:{closed_port}", "--connect-timeout", "5")
    assert out.returncode == 3, out.stderr
    assert f"coordinator at 127.0.0.1:{closed_port} is unreachable" in out.stderr


def test_usage_errors_exit_2(closed_port: int) -> None:
    bad_flag = _run("status", "--bogus")
    assert bad_flag.returncode == 2 and "unrecognized arguments: --bogus" in bad_flag.stderr, bad_flag.stderr
    no_port = _run("status", "--coordinator", "127.0.0.1")
    assert no_port.returncode == 2 and "missing :PORT?" in no_port.stderr, no_port.stderr
    bad_set = _run("submit", str(DIGITS_TOML), "--set", "lr", "-c", f"127.0.0.1:{closed_port}")
    assert bad_set.returncode == 2 and "--set: expects FIELD=VALUE, got 'lr'" in bad_set.stderr, bad_set.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSAMER_")}
    bad_env = subprocess.run([str(GOSSAMER), "status"], capture_output=True, text=True, timeout=60,
                             env={**env, "GOSSAMER_CONNECT_TIMEOUT": "soon"})
    assert bad_env.returncode == 2 and "(from GOSSAMER_CONNECT_TIMEOUT)" in bad_env.stderr, bad_env.stderr


def test_an_unknown_experiment_exits_1(live: InProcessCoordinator) -> None:
    out = _run("status", "no-such-exp", "--coordinator", live.address)
    assert out.returncode == 1 and "no-such-exp" in out.stderr, out.stderr


def test_a_failed_run_followed_to_its_end_exits_1(live: InProcessCoordinator, tmp_path: Path) -> None:
    nodes = Nodes(live.address)  # two nodes that join and heartbeat, but never start the shard they are given
    try:
        nodes.join("ps", "wk")
        spec = tmp_path / "fails.toml"
        spec.write_text("\n".join([
            'name = "fails"', f'model = "{DIGITS["model"]}"', f'dataset = "{DIGITS["dataset"]}"',
            "num_ps_shards = 1", "min_workers = 1", "max_workers = 1", "ps_backup = false", ""]))
        out = _run("submit", str(spec), "--wait", "--quiet", "--set", "start_timeout_s=1", "--coordinator", live.address)
    finally:
        nodes.close()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "failed" in out.stdout and "did not start within 1 s (start_timeout_s)" in out.stdout, out.stdout
