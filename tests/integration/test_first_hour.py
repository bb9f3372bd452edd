"""The first hour, through the real CLI: docs/quickstart.md's commands, the README's Python block, queued and
cancelled experiments as status/submit/watch/the status page show them, `worker join` to a wrong address, and
`gossamer local down` leaving no process behind.

One local cluster (`gossamer local up`, as the quickstart starts it) serves the module; its
teardown stops it even when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gossamer.tools.local_up import down, group_members, read_info
from tests._doc_blocks import ROOT, Block, blocks

pytestmark = pytest.mark.slow
QUICKSTART = ROOT / "docs" / "quickstart.md"


@dataclass
class Session:
    """A shell as a newcomer has it: a directory of their own, `gossamer` on PATH, the local cluster's dir."""

    cwd: Path
    env: dict[str, str]
    outputs: dict[str, subprocess.CompletedProcess[str]]

    def run(self, command: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(["bash", "-c", command], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        self.outputs[command] = out
        return out

    def popen(self, *argv: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "gossamer.tools.cli", *argv], cwd=self.cwd, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    @property
    def local_dir(self) -> Path:
        return Path(self.env["GOSSAMER_LOCAL_DIR"])


def _env(local_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSAMER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["GOSSAMER_LOCAL_DIR"] = str(local_dir)
    return env


def _quickstart_steps() -> tuple[list[Block], Block]:
    """The quickstart's blocks up to its last (`gossamer local down`), and that one."""
    bs = [b for b in blocks(QUICKSTART) if b.mode != "skip"]
    assert bs[-1].commands() == ["gossamer local down"], bs[-1]
    return bs[:-1], bs[-1]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """Runs docs/quickstart.md up to `local down` in a fresh directory; stops the cluster afterwards, whatever happened."""
    home = tmp_path_factory.mktemp("newcomer")
    s = Session(home, _env(home / "local"), {})
    steps, _ = _quickstart_steps()
    try:
        for b in steps:
            if b.mode == "file":
                (home / b.args).write_text(b.text)
                continue
            assert b.mode == "shell", b.where
            for command in b.commands():
                out = s.run(command)
                assert out.returncode == 0, f"{b.where}: `{command}` exited {out.returncode}\n{out.stdout}\n{out.stderr}"
        yield s
    finally:
        info = read_info(s.local_dir)
        down(s.local_dir, grace_s=0.0)
        if info is not None:
            assert not any(group_members(p) for p in info.pids.values())


def _status_json(s: Session, *argv: str) -> dict:  # type: ignore[type-arg]
    out = s.run(" ".join(["gossamer", "status", *argv, "--local", "--json"]))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _wait_for(pred, what: str, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


# --- docs/quickstart.md ------------------------------------------------------------------------------
def test_the_quickstart_trains_the_users_own_model_on_the_local_cluster(session: Session) -> None:
    up = session.outputs["gossamer local up"]
    address = re.search(r"coordinator\s+(127\.0\.0\.1:\d+)", up.stdout)
    page = re.search(r"status page\s+(http://\S+)", up.stdout)
    assert address and page, up.stdout
    with urllib.request.urlopen(page.group(1) + "healthz", timeout=10) as r:  # the status page is on
        assert r.read().strip() == b"ok"
    submit = session.outputs["gossamer submit my_experiment.toml --local --wait"]
    assert re.search(r"^completed: completed 300 steps", submit.stdout, re.M), submit.stdout + submit.stderr
    acc = float(re.search(r"final eval accuracy: ([\d.]+)", submit.stdout).group(1))  # type: ignore[union-attr]
    assert acc > 0.9, submit.stdout  # three well-separated blobs
    status = session.outputs["gossamer status --local"].stdout
    assert "my-first" in status and "completed" in status and "spot-4" in status, status


# --- the README's Python block ---------------------------------------------------------------------
def test_the_readme_python_block_runs(session: Session) -> None:
    (block,) = [b for b in blocks(ROOT / "README.md") if b.mode == "python"]
    info = read_info(session.local_dir)
    assert info is not None and "nodes=5" in block.args
    script = session.cwd / "readme_example.py"
    script.write_text(block.substituted(address=info.address))
    out = subprocess.run([sys.executable, str(script)], cwd=session.cwd, env=session.env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    acc, bytes_up = map(float, out.stdout.split())
    assert 0 < acc <= 1 and bytes_up > 0, out.stdout


# --- item 1 and 8: queued, cancelled -----------------------------------------------------------------
def test_a_queued_experiment_says_what_it_waits_for_everywhere(session: Session) -> None:
    examples = ROOT / "examples" / "digits.toml"
    sub = session.run(f"gossamer submit {examples} --local --set min_workers=8")
    assert sub.returncode == 0, sub.stderr
    exp_id = sub.stdout.strip()
    expected = ("waiting for 10 nodes (2 for shards, on-demand preferred; 8 for workers); 5 free (2 on-demand, "
                "3 spot); the cluster has 5 live nodes: 5 more must join")
    assert f"gossamer: warning: {exp_id} is queued: {expected}" in sub.stderr, sub.stderr
    st = _status_json(session, exp_id)
    assert (st["state"], st["message"]) == ("queued", expected)
    assert expected in session.run(f"gossamer status {exp_id} --local").stdout
    info = read_info(session.local_dir)
    assert info is not None
    with urllib.request.urlopen(info.status_page + "api/status", timeout=10) as r:
        (api,) = [e for e in json.load(r)["experiments"] if e["id"] == exp_id]
    assert api["message"] == expected
    # submit --wait says it too, then the outcome with the steps reached
    follower = session.popen("submit", str(examples), "--local", "--set", "min_workers=8", "--wait", "--quiet")
    watcher = session.popen("watch", exp_id, "--local")
    try:
        second = follower.stdout.readline().strip()  # type: ignore[union-attr]
        behind = f"queued behind {exp_id}; waiting for 10 nodes"  # FIFO: behind the first, and for its own nodes
        line = follower.stderr.readline()  # type: ignore[union-attr]
        assert f"warning: {second} is queued: {behind}" in line, line
        line = follower.stderr.readline()  # type: ignore[union-attr]
        assert f"{second} queued: {behind}" in line, line
        line = watcher.stderr.readline()  # type: ignore[union-attr]
        assert f"following {exp_id}" in line, line  # Ctrl-C is handled from here on
        watcher.send_signal(signal.SIGINT)
        wout, _ = watcher.communicate(timeout=30)
        assert watcher.returncode == 130
        assert f"detached from {exp_id}; it stays queued (waiting for 10 nodes" in " ".join(wout.split()), wout
        for i in (exp_id, second):
            assert session.run(f"gossamer cancel {i} --local").returncode == 0
        fout, _ = follower.communicate(timeout=30)
        assert follower.returncode == 1 and "cancelled: cancelled by user (step 0/1500)" in fout, fout
    finally:
        for p in (follower, watcher):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_a_cancelled_run_shows_the_steps_it_reached(session: Session) -> None:
    # the case: async digits cancelled after an eval showed `0/1500` next to its accuracy
    sub = session.run(f"gossamer submit {ROOT / 'examples' / 'digits.toml'} --local --set total_steps=100000 "
                      "--set eval_every=20")
    assert sub.returncode == 0, sub.stderr
    exp_id = sub.stdout.strip()
    _wait_for(lambda: "eval_accuracy" in _status_json(session, exp_id)["metrics"], "a first eval")
    assert session.run(f"gossamer cancel {exp_id} --local").returncode == 0
    st = _status_json(session, exp_id)
    assert st["state"] == "cancelled" and st["steps"] >= 20, st
    out = session.run(f"gossamer status {exp_id} --local").stdout
    assert f"step {st['steps']}/100000" in out, out
    listing = session.run("COLUMNS=250 gossamer status --local").stdout  # no id cut short by the table
    assert re.search(rf"{exp_id}.*cancelled.*{st['steps']}/100000", listing), listing
    watched = session.run(f"gossamer watch {exp_id} --local")  # a finished run: the summary at once
    assert watched.returncode == 1 and re.search(rf"steps\s+{st['steps']}/100000", watched.stdout), watched.stdout


# --- item 7: local down -----------------------------------------------------------------------------
def test_local_down_stops_every_process_local_up_started(session: Session) -> None:
    info = read_info(session.local_dir)
    assert info is not None and len(info.pids) == 6
    members = [m for pgid in info.pids.values() for m in group_members(pgid)]
    assert len(members) > 6  # the agents' role processes and fork servers are in their groups
    _, last = _quickstart_steps()
    for command in last.commands():
        out = session.run(command, timeout=120)
        assert out.returncode == 0 and f"stopped the local cluster at {info.address}" in out.stdout, out.stdout
    assert not [m for m in members if Path(f"/proc/{m}").exists() and _state(m) != "Z"]
    assert read_info(session.local_dir) is None
    again = session.run("gossamer local status")
    assert again.returncode == 1 and "no local cluster" in again.stdout


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


# --- item 4: worker join to a wrong address --------------------------------------------------------
def test_worker_join_to_a_wrong_address_keeps_saying_so_and_gives_up_with_exit_3(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env(tmp_path / "local")
    out = subprocess.run([sys.executable, "-m", "gossamer.tools.cli", "worker", "join", f"127.0.0.1:{port}",
                          "--join-timeout", "10", "--no-warm-roles"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3, out.stderr  # the coordinator did not answer (cli_parser's exit codes)
    waits = re.findall(rf"waiting for the coordinator at 127\.0\.0\.1:{port} for (\d+) s", out.stderr)
    assert len(waits) >= 2 and int(waits[-1]) >= 5, out.stderr  # said again as time passes
    assert "within --join-timeout 10 s" in out.stderr and "left the cluster" not in out.stderr, out.stderr


def test_worker_join_stopped_before_joining_does_not_claim_it_left(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gossamer.tools.cli", "worker", f"127.0.0.1:{port}", "--no-warm-roles"],
                            env=_env(tmp_path / "local"), stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = [""]
        while "waiting for the coordinator" not in lines[-1]:
            lines.append(proc.stderr.readline())  # type: ignore[union-attr]
            assert lines[-1], "".join(lines)  # EOF: it exited without saying it waits
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "stopped before joining" in err and "left the cluster" not in err, err
