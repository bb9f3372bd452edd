"""`--log-format json`: a coordinator and a node agent started with it write one JSON object per line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gossamer import Client

pytestmark = pytest.mark.timeout(120)


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def _records(out: str) -> list[dict[str, object]]:
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines
    return [json.loads(line) for line in lines]  # every line parses


def test_coordinator_and_agent_write_parseable_json_lines(tmp_path: Path) -> None:
    ready = tmp_path / "port"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gossamer.tools.cli"]
    coord = subprocess.Popen([*cmd, "coordinator", "serve", "--port", "0", "--state-dir", str(tmp_path / "state"),
                              "--ready-file", str(ready), "--log-format", "json"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    agent: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert coord.poll() is None and time.monotonic() < deadline, "coordinator did not start"
            time.sleep(0.05)
        address = f"127.0.0.1:{ready.read_text()}"
        # The environment sets the format too (GOSSAMER_LOG_FORMAT); a flag would win over it.
        agent = subprocess.Popen([*cmd, "worker", "join", address, "--name", "n0"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env={**env, "GOSSAMER_LOG_FORMAT": "json"})
        with Client(address) as client:
            while not any(n["name"] == "n0" and n["state"] == "ready" for n in client.nodes()):
                assert agent.poll() is None and time.monotonic() < deadline + 30, "node did not join"
                time.sleep(0.1)
        agent_out = _stop(agent)
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        coord_out = _stop(coord)

    coord_records = _records(coord_out)
    assert all({"ts", "level", "logger", "msg"} <= set(r) and r["role"] == "coordinator" for r in coord_records)
    assert any("node n0 joined" in str(r["msg"]) for r in coord_records)
    agent_records = _records(agent_out)
    assert all(r["role"] == "agent" for r in agent_records)
    assert any(str(r["msg"]).startswith("joined") and r["node"] == "n0" for r in agent_records)
