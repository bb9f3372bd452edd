"""What a coordinator exposes: its HTTP side binds loopback unless asked and asks for a token (the read-only viewer
token, never stored as the join token), an open one warns loudly, security material is never silently re-issued, and submit-time import checks are cached and capped."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from gossamer import Client, ConfigError
from gossamer.core.errors import AuthError
from gossamer.security.token import bearer
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc
from tests._fixtures import InProcessCoordinator, StartCoordinator
from tests.chaos._wait import wait_for

pytestmark = pytest.mark.timeout(300)

TOKEN = "s3cret-token-for-tests"
#: The `serve` fixture: `(*ARGS) -> (gRPC port, HTTP port, log path)`.
Serve = Callable[..., tuple[int, int, Path]]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gossamer.tools.cli", *args]


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


def _viewer_cluster(start_coordinator: StartCoordinator, tmp_path: Path) -> tuple[InProcessCoordinator, str]:
    """A coordinator with a join token serving its HTTP side, and the viewer token it wrote to its state dir."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    c = start_coordinator(http=True, token_file=str(token), check_imports=False)
    viewer_file = Path(c.config.state_dir) / "viewer.token"
    assert stat.S_IMODE(viewer_file.stat().st_mode) == 0o600
    viewer = viewer_file.read_text().strip()
    assert viewer and viewer != TOKEN and TOKEN not in viewer
    return c, viewer


def test_the_viewer_token_opens_the_page_api_and_metrics_the_join_token_still_does_and_a_wrong_one_is_refused(
        start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    c, viewer = _viewer_cluster(start_coordinator, tmp_path)
    exp = Client(c.address, token=TOKEN).submit({"name": "looked-at", "model": "m:model", "dataset": "m:data",
                                                 "total_steps": 10})
    paths = ("/", "/index.html", "/api/status", f"/api/series?experiment={exp.id}", "/metrics")
    for path in paths:
        status, body, _ = _get(c.base + path, {"Authorization": f"Bearer {viewer}"})
        assert status == 200, (path, status, body)
        assert TOKEN.encode() not in body and viewer.encode() not in body, path
    status, body, _ = _get(c.base + "/api/status", {"Authorization": f"Bearer {viewer}"})
    assert [e["id"] for e in json.loads(body)["experiments"]] == [exp.id]
    assert b"gossamer_nodes" in _get(c.base + "/metrics", {"Authorization": f"Bearer {viewer}"})[1]
    # Scrapers and scripts set up with the join token keep working on the read-only routes.
    for path in ("/api/status", "/metrics"):
        assert _get(c.base + path, {"Authorization": f"Bearer {TOKEN}"})[0] == 200, path
    refused = c.server.http.gate.refused
    for path in paths:
        for headers in ({"Authorization": "Bearer " + viewer[:-1] + ("A" if viewer[-1] != "A" else "B")},
                        {"Authorization": f"Bearer {TOKEN}x"}, {"Cookie": "gossamer_token=wrong"}, {}):
            assert _get(c.base + path, headers)[0] == 401, (path, headers)
    assert c.server.http.gate.refused == refused + 4 * len(paths)
    # A wrong bearer is not rescued by a right cookie: the header says who is asking.
    assert _get(c.base + "/api/status", {"Authorization": "Bearer wrong", "Cookie": f"gossamer_token={viewer}"})[0] == 401


def test_the_page_s_cookie_is_the_viewer_token_which_cannot_join_submit_or_cancel_over_grpc(
        start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    c, viewer = _viewer_cluster(start_coordinator, tmp_path)
    job = Client(c.address, token=TOKEN).submit({"name": "kept", "model": "m:model", "dataset": "m:data",
                                                 "total_steps": 10})
    cookies = []
    for presented in (viewer, TOKEN):  # a browser opened with either token gets the same cookie
        status, body, headers = _get(c.base + f"/?token={presented}")
        assert status == 303 and headers["Location"] == "/" and body == b""
        assert TOKEN not in headers["Set-Cookie"] and "HttpOnly" in headers["Set-Cookie"]
        cookies.append(headers["Set-Cookie"].split(";")[0])
    assert cookies == [f"gossamer_token={viewer}"] * 2
    status, page, headers = _get(c.base + "/", {"Cookie": cookies[0]})
    assert status == 200 and b"<script>" in page and "Set-Cookie" not in headers
    assert TOKEN.encode() not in page and viewer.encode() not in page  # neither token is in the HTML or its script
    assert _get(c.base + "/api/status", {"Cookie": cookies[0]})[0] == 200

    # What the browser holds opens nothing on the gRPC side: no join, no submit, no cancel.
    cookie_token = cookies[0].partition("=")[2]
    with grpc.insecure_channel(c.address) as channel:
        nodes = pb_grpc.NodeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            nodes.Join(pb.JoinRequest(name="intruder", address="127.0.0.1"), timeout=10,
                       metadata=[bearer(cookie_token)])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    viewer_client = Client(c.address, token=cookie_token)
    with pytest.raises(AuthError, match="refused the token"):
        viewer_client.submit({"name": "intruder", "model": "m:model", "dataset": "m:data", "total_steps": 10})
    with pytest.raises(AuthError, match="refused the token"):
        viewer_client.job(job.id).cancel()
    member = Client(c.address, token=TOKEN)
    assert member.nodes() == [] and [e["name"] for e in member.experiments()] == ["kept"]
    assert job.status()["state"] == "queued"


def test_a_cookie_that_held_the_join_token_is_served_once_and_replaced_by_the_viewer_token(
        start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    c, viewer = _viewer_cluster(start_coordinator, tmp_path)
    status, _, headers = _get(c.base + "/api/status", {"Cookie": f"gossamer_token={TOKEN}"})
    assert status == 200 and headers["Set-Cookie"].split(";")[0] == f"gossamer_token={viewer}"


def test_gossamer_security_viewer_token_prints_the_token_the_coordinator_derived(serve: Serve, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    _, http_port, log = serve("--token-file", str(token))
    written = (log.parent / "viewer.token").read_text().strip()
    assert f"viewer token in {log.parent / 'viewer.token'}" in log.read_text() and TOKEN not in log.read_text()
    printed = subprocess.run(_cli("security", "viewer-token", "--token-file", str(token)), capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0 and printed.stdout.strip() == written, printed
    assert _get(f"http://127.0.0.1:{http_port}/api/status", {"Authorization": f"Bearer {written}"})[0] == 200


def test_a_viewer_token_file_is_used_as_given_and_one_holding_the_join_token_is_refused(
        serve: Serve, tmp_path: Path) -> None:
    token, viewer = tmp_path / "token", tmp_path / "viewer"
    token.write_text(TOKEN + "\n")
    viewer.write_text("a-viewer-token-for-tests\n")
    _, http_port, log = serve("--token-file", str(token), "--viewer-token-file", str(viewer))
    base = f"http://127.0.0.1:{http_port}"
    assert _get(base + "/api/status", {"Authorization": "Bearer a-viewer-token-for-tests"})[0] == 200
    assert _get(base + "/?token=a-viewer-token-for-tests")[2]["Set-Cookie"].startswith(
        "gossamer_token=a-viewer-token-for-tests;")
    assert f"viewer token in {viewer}" in log.read_text()
    assert not (log.parent / "viewer.token").exists()  # nothing derived when one is given
    viewer.write_text(TOKEN + "\n")
    proc = subprocess.run(_cli("coordinator", "serve", "--port", "0", "--state-dir", str(tmp_path / "refused"),
                               "--token-file", str(token), "--viewer-token-file", str(viewer)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "viewer_token_file" in proc.stderr and "join token" in proc.stderr, proc.stderr


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
