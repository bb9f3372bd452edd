"""The coordinator's status page renders in headless Chromium: nodes, the experiment, charts drawn by its script,
the straggler highlighted; a screenshot is taken and checked; opened with the viewer token, it renders too."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gossamer import Client
from gossamer.tools.local_cluster import LocalCluster
from tests._fixtures import StartCoordinator
from tests.integration._observability import HTTP_ENV, SLOW, digits, http_port, wait_ready

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.cluster(env=HTTP_ENV),
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"{CHROMIUM} is missing: apt-get install chromium (Debian) to check the status page"),
]


def _chromium(tmp: Path, url: str, *extra: str, timeout: float = 120.0) -> str:
    """Run headless Chromium on `url`; its stdout. Every process it starts is killed afterwards."""
    profile = tmp / "chromium-profile"
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--window-size=1280,900", "--virtual-time-budget=5000", *extra, url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # renderer and zygote processes left behind, if any
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_status_page_renders_nodes_experiment_charts_and_straggler_in_headless_chromium(
        cluster: LocalCluster, tmp_path: Path) -> None:
    address = cluster.start_coordinator(port=0)
    url = f"http://127.0.0.1:{http_port(cluster)}/"
    cluster.add_node("ps")
    for name in ("fast0", "fast1"):
        cluster.add_node(name, spot=True)
    cluster.add_node("slow", spot=True, env=SLOW)
    client = Client(address)
    wait_ready(client, 4)
    job = client.submit(digits("status-page", workers=3, staleness=None, eval_every=50))
    try:
        deadline = time.monotonic() + 240
        while True:  # several evaluations in, and the slow worker flagged
            st = job.status()
            if st["metrics"].get("eval_step", 0) >= 150 and any(r["straggler"] for r in st["roles"]):
                break
            assert st["state"] in ("queued", "starting", "running"), st
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
        dom = _chromium(tmp_path, url, "--dump-dom")
        shot = tmp_path / "page.png"
        _chromium(tmp_path, url, f"--screenshot={shot}")
    finally:
        job.cancel()
        client.close()

    # The script ran (it marks the body once it has rendered the API's answer) ...
    assert 'data-rendered="true"' in dom, dom[-2000:]
    assert job.id in dom and "status-page" in dom
    for node in ("ps", "fast0", "fast1", "slow"):
        assert f'data-node="{node}"' in dom
    # ... drew the three charts, each a line through several points ...
    charts = dict(re.findall(r'data-series="(\w+)" data-points="(\d+)"', dom))
    assert set(charts) == {"loss", "eval_accuracy", "samples_per_s"}, charts
    assert all(int(n) >= 2 for n in charts.values()), charts
    assert dom.count('class="chart-line"') == 3
    # ... and highlighted the straggler in the nodes table and the roles table.
    assert re.search(r'<tr class="straggler" data-node="slow">', dom), dom
    assert dom.count('class="badge straggler"') == 2
    assert not re.search(r'<tr class="straggler" data-node="fast', dom)

    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 1280 and int.from_bytes(png[20:24], "big") == 900
    assert len(png) > 30_000, len(png)  # a blank page of this size compresses to a few KiB
    from PIL import Image

    with Image.open(shot) as img:
        colors = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20) or []}
    assert len(colors) > 200, len(colors)  # text, tables, charts: not a blank or error page
    assert (0xFF, 0xF1, 0xF3) in colors  # the straggler row's highlight


def test_status_page_opened_with_the_viewer_token_renders_in_headless_chromium_and_holds_no_join_token(
        start_coordinator: StartCoordinator, tmp_path: Path) -> None:
    join = "join-token-only-for-members-0123"
    (tmp_path / "token").write_text(join + "\n")
    c = start_coordinator(http=True, token_file=str(tmp_path / "token"), check_imports=False)
    viewer = (Path(c.config.state_dir) / "viewer.token").read_text().strip()
    job = Client(c.address, token=join).submit(digits("viewed", workers=1))
    # ?token= answers with a redirect that sets the cookie; the page's own fetches of /api carry it.
    dom = _chromium(tmp_path, f"{c.base}/?token={viewer}", "--dump-dom")
    assert 'data-rendered="true"' in dom, dom[-2000:]
    assert job.id in dom and "viewed" in dom
    assert join not in dom and viewer not in dom
    refused = _chromium(tmp_path, f"{c.base}/?token=wrong", "--dump-dom")
    assert "token required" in refused and 'data-rendered="true"' not in refused
