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

from gossamer.core import zygote
from gossamer.node.warm import start_shared

#: A stand-in node: warms up as an agent does, starts two roles, reports what they saw, then
#: either exits or (argv[1] == "hold") keeps a role running and waits to be killed.
NODE = r'''
import json, os, sys, time
from gossamer.node.warm import role_context, warm_up

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


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One zygote for every test here, as a host's nodes share one (each import of the role code: 4 s of CPU)."""
    proc, path = start_shared(tmp_path_factory.mktemp("zygote"))
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


CHECKS = r'''
import asyncio, json, os
from gossamer.coordinator.import_checks import ImportChecker
from gossamer.core.errors import ConfigError
from gossamer.core.experiment import Experiment

async def main():
    checker, out = ImportChecker(), {}
    for name, model in (("good", "gossamer.examples.digits:mlp"), ("bad", "no_such_module_here:model"),
                        ("user", "user_mod:model")):
        exp = Experiment(name=name, model=model, dataset="gossamer.examples.digits:data", total_steps=10)
        try:
            await checker.check(exp)
            out[name] = "ok"
        except ConfigError as e:
            out[name] = f"{e.field}: {e}"
    print(json.dumps(out))

if __name__ == "__main__":  # the checks fork and load this as __mp_main__ (as the CLI's main module is)
    asyncio.run(main())
'''


def test_import_checks_give_the_same_verdicts_forked_from_the_zygote_as_in_a_fresh_interpreter(
        tmp_path: Path, shared: str) -> None:
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "user_mod.py").write_text("def model():\n    return None\n")
    (tmp_path / "checks.py").write_text(CHECKS)
    verdicts = {}
    for how in ("warm", "cold"):
        env = {k: v for k, v in os.environ.items() if k != zygote.ENV}
        # the user's module is on PYTHONPATH only: a fresh interpreter finds it, and so must a fork
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "mods"), *sys.path])
        if how == "warm":
            env[zygote.ENV] = shared
        proc = subprocess.run([sys.executable, str(tmp_path / "checks.py")], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, process_group=0)
        assert proc.returncode == 0, proc.stderr
        verdicts[how] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert ("fork server" in proc.stderr) is False, proc.stderr  # the warm run did adopt the zygote
    assert verdicts["warm"] == verdicts["cold"]
    assert verdicts["warm"]["good"] == "ok" and verdicts["warm"]["user"] == "ok"
    assert verdicts["warm"]["bad"].startswith("model") and "no_such_module_here" in verdicts["warm"]["bad"]
