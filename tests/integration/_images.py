"""Builds deploy/docker's CPU image for the container tests, with stand-ins for what a sandbox cannot reach."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON_IMAGE = "python:3.11-slim"
#: A Python 3.11 image made from Debian's packages, for a machine that reaches Debian's mirror but not Docker Hub.
LOCAL_BASE = "gossamer-test-base:bookworm-py311"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
BUILD_TIMEOUT_S = 1800
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class Unavailable(Exception):
    """What the machine lacks to build or run the image, in words a skip can show."""


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: exit {out.returncode}: {out.stderr.strip()[-2000:]}")
    return out


def require_docker() -> None:
    if shutil.which("docker") is None:
        raise Unavailable("no docker client on PATH")
    out = docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
    if out.returncode != 0:
        raise Unavailable(f"`docker info` failed: {out.stderr.strip()}")


def python_base() -> str:
    """The base image: $DEPLOY_TEST_PYTHON_IMAGE, else python:3.11-slim (pulled), else one built from Debian."""
    if image := os.environ.get("DEPLOY_TEST_PYTHON_IMAGE"):
        return image
    if docker("image", "inspect", PYTHON_IMAGE, check=False).returncode == 0:
        return PYTHON_IMAGE
    pulled = docker("pull", PYTHON_IMAGE, timeout=600, check=False)
    if pulled.returncode == 0:
        return PYTHON_IMAGE
    if docker("image", "inspect", LOCAL_BASE, check=False).returncode == 0:
        return LOCAL_BASE
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise Unavailable(f"`docker pull {PYTHON_IMAGE}` failed ({pulled.stderr.strip()}) and no Debian base can be "
                          "built here (needs root and debootstrap); set DEPLOY_TEST_PYTHON_IMAGE")
    build_debian_base()
    return LOCAL_BASE


def build_debian_base() -> None:
    """Debian bookworm's python3.11 with a venv at /usr/local: `python`, `pip` on PATH, as in the official image."""
    with tempfile.TemporaryDirectory(prefix="gossamer-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3.11,python3.11-venv,python3-venv,ca-certificates",
                        "bookworm", str(rootfs), "http://deb.debian.org/debian"],
                       check=True, capture_output=True, timeout=900)
        subprocess.run(["chroot", str(rootfs), "python3.11", "-m", "venv", "/usr/local"], check=True, timeout=300)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        # The CAs this machine trusts (a TLS-inspecting proxy's among them) and pip told to use them: pip
        # otherwise trusts only its own bundle.
        shutil.copy(HOST_CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-c", "ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "-c", "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt", "-", LOCAL_BASE],
                       stdin=tar.stdout, check=True, capture_output=True, timeout=600)
        assert tar.wait(timeout=60) == 0


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


@contextmanager
def torch_index() -> Iterator[str | None]:
    """The TORCH_INDEX_URL build argument: None (the Dockerfile's PyTorch CPU index) where that index answers,
    else a simple index on loopback serving torch's CPU wheel and its dependencies as this machine's pip finds them."""
    if url := os.environ.get("DEPLOY_TEST_TORCH_INDEX"):
        yield url
        return
    if reachable(f"{TORCH_INDEX}/torch/"):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="gossamer-torch-index-") as tmp:
        files = Path(tmp) / "files"
        out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "torch==2.13.0", "-d", str(files)],
                             capture_output=True, text=True, timeout=900)
        wheels = sorted(files.glob("*.whl"))
        if out.returncode != 0 or not any(w.name.startswith("torch-") and "+cpu" in w.name for w in wheels):
            raise Unavailable(f"{TORCH_INDEX} does not answer and pip finds no CPU build of torch==2.13.0 here: "
                              f"{out.stderr.strip()[-500:] or [w.name for w in wheels]}")
        for wheel in wheels:  # PEP 503: /simple/<normalized name>/ lists the project's files
            name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
            page = Path(tmp) / "simple" / name
            page.mkdir(parents=True, exist_ok=True)
            (page / "index.html").write_text(f'<a href="../../files/{wheel.name}">{wheel.name}</a>\n')
        handler = functools.partial(_QuietHandler, directory=tmp)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/simple"
        finally:
            server.shutdown()
            server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def build_cpu_image(tag: str) -> None:
    """`docker build -f deploy/docker/Dockerfile` from the repository root, as docs/deploy.md says."""
    require_docker()
    args = ["build", "--network", "host", "-f", str(ROOT / "deploy/docker/Dockerfile"), "-t", tag]
    base = python_base()
    if base != PYTHON_IMAGE:
        args += ["--build-arg", f"PYTHON_IMAGE={base}"]
    with torch_index() as index:
        if index:
            args += ["--build-arg", f"TORCH_INDEX_URL={index}"]
        docker(*args, str(ROOT), timeout=BUILD_TIMEOUT_S)
