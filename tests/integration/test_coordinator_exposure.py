"""What a coordinator exposes: its HTTP side binds loopback unless asked and asks for the token, an open one warns
loudly, security material is never silently re-issued, and submit-time import checks are cached and capped."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gossamer import Client, ConfigError
from tests._fixtures import StartCoordinator
from tests.chaos._wait import wait_for

pytestmark = pytest.mark.timeout(300)

TOKEN = "s3cret-token-for-tests"
#: The `serve` fixture: `(*ARGS) -> (gRPC port, HTTP port, log path)`.
Serve = Callable[..., tuple[int, int, Path]]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gossamer.cli", *args]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Start `gossamer coordinator serve ARGS` (its own state dir, port 0); stopped after the test."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(*args: str) -> tuple[int, int, Path]:
        state = tmp_path / f"state{len(procs)}"
        state.mkdir()
        ready, log = state / "ready", state / "coordinator.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(_cli("coordinator", "serve", "--port", "0", "--http-port", "0", "--state-dir",
                                         str(state), "--ready-file", str(ready), *args),
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((proc, log))
        wait_for(lambda: ready.exists() or proc.poll() is not None, 120, "the coordinator to serve")
        assert proc.poll() is None, log.read_text()
        return int(ready.read_text()), int((state / "http.port").read_text()), log

    yield start
    for proc, _ in procs:
        proc.terminate()
    for proc, _ in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers or {})

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a: object, **k: object) -> None:
            return None

    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_http_side_binds_loopback_unless_asked_and_a_guarded_start_does_not_warn(serve: Serve, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    grpc_port, http_port, log = serve("--host", "0.0.0.0", "--token-file", str(token))
    # 127.0.0.2 is this machine too, but not the address 127.0.0.1: only a wildcard bind answers it.
    assert _reachable("127.0.0.2", grpc_port)  # --host 0.0.0.0, as asked
    assert not _reachable("127.0.0.2", http_port)  # the HTTP side stayed on 127.0.0.1
    assert _get(f"http://127.0.0.1:{http_port}/healthz")[0] == 200
    _, asked_http, asked_log = serve("--host", "0.0.0.0", "--http-host", "0.0.0.0", "--token-file", str(token))
    assert _reachable("127.0.0.2", asked_http)
    for text in (log.read_text(), asked_log.read_text()):
        assert "UNPROTECTED" not in text, text


def test_coordinator_open_to_other_hosts_without_token_or_mtls_warns_loudly(serve: Serve) -> None:
    _, _, log = serve("--host", "0.0.0.0", "--http-host", "0.0.0.0")
    text = log.read_text()
    assert "UNPROTECTED: the coordinator's gRPC port is bound to 0.0.0.0" in text, text
    assert "UNPROTECTED: the coordinator's HTTP side (status page, /api, /metrics) is bound to 0.0.0.0" in text, text
    _, _, quiet = serve()  # loopback only: nothing to warn about
    assert "UNPROTECTED" not in quiet.read_text()


def test_http_side_asks_for_the_token_and_a_browser_gets_it_once(start_coordinator: StartCoordinator,
                                                                 tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    c = start_coordinator(http=True, token_file=str(token), check_imports=False)
    for path in ("/", "/api/status", "/api/series?experiment=x", "/metrics"):
        status, body, _ = _get(c.base + path)
        assert status == 401 and b"Authorization: Bearer" in body, (path, status, body)
        assert _get(c.base + path, {"Authorization": "Bearer wrong"})[0] == 401
    assert _get(c.base + "/healthz")[0] == 200  # probes need no token
    status, body, _ = _get(c.base + "/api/status", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and b'"experiments"' in body
    assert _get(c.base + "/metrics", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    # A browser: /?token= once sets a cookie and leaves the token out of the address; the page's
    # own requests then carry the cookie.
    assert _get(c.base + "/?token=wrong")[0] == 401
    status, _, headers = _get(c.base + f"/?token={TOKEN}")
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"].split(";")[0]
    assert "HttpOnly" in headers["Set-Cookie"]
    for path in ("/", "/api/status"):
        assert _get(c.base + path, {"Cookie": cookie})[0] == 200, path


def test_missing_secure_file_is_an_error_naming_it_not_a_new_ca(tmp_path: Path) -> None:
    secure = tmp_path / "secure"
    made = subprocess.run(_cli("security", "init", str(secure)), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    ca = hashlib.sha256((secure / "ca.crt").read_bytes()).hexdigest()
    (secure / "client" / "token").unlink()
    state = tmp_path / "state"
    proc = subprocess.run(_cli("coordinator", "serve", "--port", "0", "--state-dir", str(state), "--secure",
                               str(secure)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert f"lacks {secure / 'client' / 'token'}" in proc.stderr, proc.stderr
    assert hashlib.sha256((secure / "ca.crt").read_bytes()).hexdigest() == ca  # nothing re-issued
    assert not (secure / "client" / "token").exists()
    # Into an empty directory it still issues a fresh set.
    empty = tmp_path / "empty"
    empty.mkdir()
    made = subprocess.run(_cli("security", "init", str(empty)), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and (empty / "client" / "token").is_file(), made.stderr


_SLOW_MODULE = textwrap.dedent(
    """
    import os, time
    with open(os.environ["IMPORT_LOG"], "a") as f:
        f.write(f"start {__name__} {time.time()}\\n")
    time.sleep(1.0)
    with open(os.environ["IMPORT_LOG"], "a") as f:
        f.write(f"end {__name__} {time.time()}\\n")
    if __name__.startswith("broken"):
        raise RuntimeError("this module does not import")
    def model(): pass
    def data(): pass
    """
)


def _max_overlap(lines: list[str]) -> int:
    events = sorted((float(t), 1 if kind == "start" else -1) for kind, _, t in (line.split() for line in lines))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def test_import_checks_are_capped_in_concurrency_and_cached(start_coordinator: StartCoordinator, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    names = [f"slow{i}" for i in range(6)] + ["broken0"]
    for name in names:
        (mods / f"{name}.py").write_text(_SLOW_MODULE)
    log = tmp_path / "imports.log"
    log.touch()
    monkeypatch.setenv("IMPORT_LOG", str(log))  # the import checks' child processes inherit these
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")]))
    c = start_coordinator(check_imports=True, import_check_concurrency=2)
    client = Client(c.address)
    outcomes: dict[str, str] = {}

    def submit(name: str, i: int) -> None:
        try:
            client.submit({"name": f"{name}-{i}", "model": f"{name}:model", "dataset": f"{name}:data",
                           "total_steps": 10})
            outcomes[f"{name}-{i}"] = "ok"
        except ConfigError as e:
            outcomes[f"{name}-{i}"] = str(e)

    # A flood: every module submitted three times at once.
    threads = [threading.Thread(target=submit, args=(n, i)) for i in range(3) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    lines = log.read_text().split("\n")[:-1]
    assert len(outcomes) == 3 * len(names)
    assert all(outcomes[f"{n}-{i}"] == "ok" for n in names if n.startswith("slow") for i in range(3)), outcomes
    assert all("model" in outcomes[f"broken0-{i}"] and "does not import" in outcomes[f"broken0-{i}"]
               for i in range(3)), outcomes
    # One child per distinct (model, dataset) — identical submits in flight share it — and never
    # more than two at once.
    starts = sorted(line.split()[1] for line in lines if line.startswith("start"))
    assert starts == sorted(names), starts
    assert _max_overlap(lines) <= 2, lines
    assert c.server.coord.import_checker.spawned == len(names)
    # Cached: a success for good, a failure for a while; no new child either way.
    submit("slow0", 9)
    submit("broken0", 9)
    assert outcomes["slow0-9"] == "ok" and "does not import" in outcomes["broken0-9"]
    assert len(log.read_text().split("\n")[:-1]) == len(lines), "a cached check ran again"
    assert c.server.coord.import_checker.spawned == len(names)


def test_an_import_check_that_times_out_queues_the_experiment_unchecked_saying_so(
        start_coordinator: StartCoordinator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow check says nothing about the user's code: it must not refuse a valid submit."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "glacial.py").write_text("import time\ntime.sleep(600)\ndef model(): pass\ndef data(): pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")]))
    c = start_coordinator(check_imports=True, import_check_timeout_s=2.0)
    client = Client(c.address)
    job = client.submit({"name": "glacial", "model": "glacial:model", "dataset": "glacial:data", "total_steps": 10})
    assert job.status()["state"] == "queued"
    notes = [e["message"] for e in job.events() if e["kind"] == "import_check"]
    assert len(notes) == 1 and "over 2 s" in notes[0] and "unchecked" in notes[0], job.events()
    assert c.server.coord.import_checker.spawned == 1
    with pytest.raises(ConfigError, match="import_check_timeout_s"):
        start_coordinator(check_imports=True, import_check_timeout_s=0.0)
