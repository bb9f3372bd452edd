"""A shared zygote: nodes of one session fork warm role servers from it, in their own process group, or start their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gossamer.worker import zygote
from gossamer.worker.warm import start_shared

#: A stand-in node: warms up as an agent does, starts two roles, reports what they saw, then
#: either exits or (argv[1] == "hold") keeps a role running and waits to be killed.
NODE = r'''
import json, os, sys, time
from gossamer.worker.warm import role_context, warm_up

def role(q):
    q.put({"pid": os.getpid(), "pgid": os.getpgrp(), "torch": "torch" in sys.modules,
           "mark": os.environ.get("MARK"), "cwd": os.getcwd()})

def hold():
    time.sleep(600)

if __name__ == "__main__":
    t0 = time.monotonic()
    warm_up()
    took = time.monotonic() - t0
    ctx = role_context(True)
    q = ctx.Queue()
    p = ctx.Process(target=role, args=(q,))
    p.start()
    seen = q.get(timeout=60)
    p.join(60)
    bad = ctx.Process(target=sys.exit, args=(3,))
    bad.start()
    bad.join(60)
    out = {"warm_s": took, "role": seen, "exit": p.exitcode, "bad_exit": bad.exitcode, "me": os.getpid()}
    if sys.argv[1:] == ["hold"]:
        h = ctx.Process(target=hold)
        h.start()
        out["held"] = h.pid
    print(json.dumps(out), flush=True)
    if sys.argv[1:] == ["hold"]:
        time.sleep(600)
'''


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[str]:
    proc, path = start_shared(tmp_path)
    try:
        yield path
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(30) == 0  # stdin closed: it exits by itself


def _node(tmp_path: Path, path: str, mark: str, *args: str, **popen: object) -> subprocess.Popen[str]:
    script = tmp_path / "node.py"
    script.write_text(NODE)
    env = {**os.environ, zygote.ENV: path, "MARK": mark, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)  # type: ignore[call-overload]


def _report(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else ""
    out: dict[str, object] = json.loads(line)
    return out


def test_nodes_in_this_session_fork_warm_roles_in_their_own_group_with_their_own_environment(
        tmp_path: Path, shared: str) -> None:
    for mark in ("a", "b"):
        proc = _node(tmp_path, shared, mark, process_group=0)
        out = _report(proc)
        assert proc.wait(60) == 0
        role = out["role"]
        assert isinstance(role, dict)
        assert role["torch"] is True  # forked from the zygote's imports, not a fresh interpreter
        assert role["pgid"] == out["me"]  # in the node's process group, as its own fork server's roles are
        assert role["mark"] == mark and role["cwd"] == str(tmp_path)
        assert out["exit"] == 0 and out["bad_exit"] == 3  # exit codes reach the node


def test_killing_the_node_group_kills_the_roles_it_forked_there(tmp_path: Path, shared: str) -> None:
    proc = _node(tmp_path, shared, "k", "hold", process_group=0)
    try:
        held = _report(proc)["held"]
        assert isinstance(held, int)
        os.kill(held, 0)
        os.killpg(proc.pid, signal.SIGKILL)  # what LocalCluster.kill_node does: a vanished machine
        proc.wait(30)
        deadline = time.monotonic() + 30
        while _alive(held):
            assert time.monotonic() < deadline, "the role outlived its node's process group"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_node_in_another_session_is_refused_and_starts_its_own_fork_server(tmp_path: Path, shared: str) -> None:
    proc = _node(tmp_path, shared, "s", start_new_session=True)
    out = _report(proc)
    assert proc.wait(120) == 0
    assert proc.stderr is not None and "starting this node's own fork server" in proc.stderr.read()
    role = out["role"]
    assert isinstance(role, dict)
    assert role["torch"] is True and role["pgid"] == out["me"] and role["mark"] == "s"


def test_an_unreachable_zygote_leaves_the_node_its_own_fork_server(tmp_path: Path) -> None:
    proc = _node(tmp_path, str(tmp_path / "nobody.sock"), "u", process_group=0)
    out = _report(proc)
    assert proc.wait(120) == 0
    role = out["role"]
    assert isinstance(role, dict) and role["torch"] is True and out["exit"] == 0
