"""Nodes on one host share a warm interpreter: a zygote forks each node's role server from its imported state."""

from __future__ import annotations

import importlib
import json
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Any

__all__ = ["ENV", "adopt", "start", "serve"]

log = logging.getLogger(__name__)

#: The zygote's socket path; a node agent that finds it set forks its role server there.
ENV = "GOSSAMER_ZYGOTE"

# A node's fork server costs about 4 s of CPU to import torch and the role code. One host that
# runs many nodes (a local cluster, the test suite) pays that once here: the zygote imports it all
# and forks a fork server for each node that asks. The fork server joins the node's process group
# (so killing the node kills its roles, as with its own fork server) and takes the node's
# environment, working directory, stdout and stderr; multiprocessing in the node then uses it as if
# it had started it. A node in another session cannot be joined: it is refused and starts its own.

_HEADER = struct.Struct("!I")  # the length of the JSON request or reply that follows


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("zygote connection closed mid-message")
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    out: dict[str, Any] = json.loads(_recv_exact(sock, n))
    return out


# --- the zygote ---------------------------------------------------------------------------


def serve(path: str, modules: tuple[str, ...]) -> None:
    """Import `modules`, then fork a fork server for each node that connects to `path`; until stdin closes."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)  # before the imports: a node that asks meanwhile waits in the backlog
        os.chmod(path, 0o600)
        listener.listen(64)
        for name in modules:
            importlib.import_module(name)
        print("ready", flush=True)  # the parent waits for this line
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        stdin = sys.stdin.fileno()
        sel.register(stdin, selectors.EVENT_READ)  # EOF: the parent is gone
        while True:
            for key, _ in sel.select(timeout=1.0):
                if key.fileobj == stdin:
                    if not os.read(stdin, 4096):
                        return
                    continue
                conn, _ = listener.accept()
                with conn:
                    try:
                        _fork_server_for(conn, listener)
                    except (OSError, ValueError, ConnectionError) as e:
                        log.warning("zygote: a request failed: %s", e)
            _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _fork_server_for(conn: socket.socket, listener: socket.socket) -> None:
    msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 4)
    if len(fds) != 4:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected 4 descriptors, got {len(fds)}")
    (n,) = _HEADER.unpack(msg + _recv_exact(conn, _HEADER.size - len(msg)))
    req = json.loads(_recv_exact(conn, n))
    server_fd, alive_r, out_fd, err_fd = fds
    go_r, go_w = os.pipe()  # the child waits until it is in the node's process group
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked fork server
        code = 0
        try:
            listener.close()
            conn.close()
            os.close(go_w)
            if os.read(go_r, 1) != b"1":
                os._exit(0)
            os.close(go_r)
            _become_fork_server(req, server_fd, alive_r, out_fd, err_fd)
        except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
            code = 1
        os._exit(code)
    os.close(go_r)
    for fd in fds:
        os.close(fd)
    try:
        os.setpgid(pid, int(req["pgid"]))
    except OSError as e:
        os.close(go_w)  # EOF: the child exits without serving
        _send(conn, {"error": f"cannot join process group {req['pgid']} (another session?): {e}"})
        return
    os.write(go_w, b"1")
    os.close(go_w)
    _send(conn, {"pid": pid})


def _become_fork_server(req: dict[str, Any], server_fd: int, alive_r: int, out_fd: int,
                        err_fd: int) -> None:  # pragma: no cover - runs in the forked fork server
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.path[:] = req["sys_path"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    for name in req.get("preload", []):
        importlib.import_module(name)
    forkserver.main(server_fd, alive_r, [])


def start(state_dir: Path, modules: tuple[str, ...], *, wait: bool = True,
          timeout: float = 120.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start a zygote that imports `modules` (its socket in `state_dir`) in this process's session; it and its path.

    Nodes started in this session with `GOSSAMER_ZYGOTE` set to the path use it. It exits when
    the returned process's stdin is closed (or this process dies). `wait=False` returns before
    its imports are done (nodes asking meanwhile wait for them), once its socket exists.
    """
    path = str(Path(state_dir) / "zygote.sock")
    code = "import sys; from gossamer.core.zygote import serve; serve(sys.argv[1], tuple(sys.argv[2:]))"
    args = [sys.executable, "-c", code, path, *modules]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=0)
    assert proc.stdout is not None
    if not wait:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the zygote did not start (exit code {proc.poll()})")
            time.sleep(0.01)
        return proc, path
    ready = proc.stdout.readline()  # blocks through the imports; EOF if it died
    if ready.strip() != b"ready":
        proc.kill()
        proc.wait(timeout)
        raise RuntimeError(f"the zygote did not start (exit code {proc.returncode})")
    proc.stdout.close()
    return proc, path


# --- a node adopting it -------------------------------------------------------------------


def adopt(path: str, preload: tuple[str, ...] = ()) -> bool:
    """Have the zygote at `path` fork this process's fork server; False (and a log line) if it cannot."""
    fs = forkserver._forkserver  # multiprocessing's own fork server record, which we fill in
    address = mp_connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    alive_r, alive_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as conn:
            server.bind(address)
            os.chmod(address, 0o600)
            server.listen()
            conn.settimeout(60.0)
            conn.connect(path)
            data = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": sys.path,
                               "preload": list(preload), "pgid": os.getpgrp()}).encode()
            socket.send_fds(conn, [_HEADER.pack(len(data))], [server.fileno(), alive_r, 1, 2])
            conn.sendall(data)
            reply = _recv(conn)
    except (OSError, ConnectionError, ValueError) as e:
        os.close(alive_w)
        log.warning("zygote %s unusable (%s); starting this node's own fork server", path, e)
        return False
    finally:
        os.close(alive_r)
    if "pid" not in reply:
        os.close(alive_w)
        log.warning("zygote %s refused: %s; starting this node's own fork server", path, reply.get("error"))
        return False
    pid = int(reply["pid"])

    def ensure_running() -> None:
        # The stock check waitpid()s the fork server, which is the zygote's child, not ours.
        resource_tracker.ensure_running()
        os.kill(pid, 0)  # ProcessLookupError: it is gone, and so is every warm start

    state: Any = fs  # the fields ForkServer.ensure_running would set when it starts one itself
    state._forkserver_address = address
    state._forkserver_alive_fd = alive_w
    state._forkserver_pid = pid
    state.ensure_running = ensure_running
    return True
