"""Warm role starts: role processes fork from a server that has already imported torch and the role code."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, SpawnContext
from pathlib import Path
from typing import Any

from gossamer.core import zygote
from gossamer.core.errors import ConfigError
from gossamer.node import late_imports

__all__ = ["ROLE_MODULES", "check_preload", "import_late", "role_context", "start_shared", "wait_for_fork_server",
           "warm_up", "warm_up_in_background"]

#: What every role process imports before its first step (2.6-2.9 s here, 2.2 s of it torch).
#: The fork server is ready to fork roles once it has these; `late_imports.LATE_MODULES` come after.
ROLE_MODULES = (
    "torch",
    "torch.distributed",
    "gossamer.node.roles",
    "gossamer.node.server_role",
    "gossamer.node.worker_role",
    "gossamer.node._fork_server_hook",  # the handler that imports LATE_MODULES when `import_late` asks
)

# "spawn" would pay those imports in every role process, on the path from an assignment to its
# first step. "fork" of the agent is unsafe: its gRPC channel and event loop do not survive it.
# The fork server is a fresh interpreter that never opens a channel; it imports ROLE_MODULES once
# and forks each role from that state (torch supports this: no CUDA or thread pool exists yet).
_WARM = mp.get_context("forkserver")
_WARM.set_forkserver_preload(list(ROLE_MODULES))
_COLD = mp.get_context("spawn")


def role_context(warm: bool) -> ForkServerContext | SpawnContext:
    """The multiprocessing context role processes start from (`warm=False`: a fresh interpreter each)."""
    return _WARM if warm else _COLD


def _ready() -> None:
    """The first process of the fork server: its return says the imports are done."""


def check_preload(modules: tuple[str, ...]) -> None:
    """Refuse a module the fork server could not import (it would skip it without a word)."""
    for name in modules:
        try:
            found = _locate(name) or importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError("preload", f"no module named {name!r} in this environment ({sys.executable})")


def _locate(name: str) -> bool:
    """Whether `name` is found on disk without importing its parent packages; False when unsure.

    `importlib.util.find_spec("a.b")` imports `a`: for `transformers.models.gpt2.modeling_gpt2`
    that cost the node agent 3 s of CPU and the memory of transformers, which it never uses.
    """
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)
    for part in rest.split(".") if rest else ():
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(f"{spec.name}.{part}", list(spec.submodule_search_locations))
    return spec is not None


def warm_up(preload: tuple[str, ...] = (), *, late: bool = True) -> float:
    """Start the fork server and wait until it has imported ROLE_MODULES and `preload`; the seconds it took.

    `preload` is what the user's roles import (their model code, `transformers`): imported once
    here, not in every role. Blocks: the agent calls it in a thread, so heartbeats go on meanwhile.
    `late`: then have it import `LATE_MODULES` (`import_late`), which this does not wait for.
    """
    _WARM.set_forkserver_preload([*ROLE_MODULES, *preload])
    t0 = time.monotonic()
    shared = os.environ.get(zygote.ENV)
    if shared:
        zygote.adopt(shared, preload)  # a warm interpreter this host already runs, when it can join it
    wait_for_fork_server()
    took = time.monotonic() - t0
    if late:
        import_late()
    return took


def wait_for_fork_server() -> None:
    """Block until the fork server answers a fork request: it has imported its preload modules, and the
    late ones too when `import_late` asked for them before (a request waits for them in its backlog)."""
    p = _WARM.Process(target=_ready, name="gossamer-warm-up", daemon=True)
    p.start()
    p.join()


def import_late() -> None:
    """Have the fork server import `LATE_MODULES` now that it serves (a role forked meanwhile waits for them)."""
    pid = _fork_server_pid()
    if pid is not None:
        try:
            os.kill(pid, late_imports.SIGNAL)
        except ProcessLookupError:
            pass


def _fork_server_pid() -> int | None:
    """This process's fork server (started here or forked for it by a zygote), if any."""
    state: Any = forkserver._forkserver
    pid: int | None = state._forkserver_pid
    return pid


def stop_fork_server() -> None:
    """Kill this process's fork server (started here or forked for it by a zygote), if any.

    A fork server notices its parent's exit only once it has imported its preload modules:
    one still importing torch when the node stopped (seconds on a loaded machine) was left
    behind that long. The roles it forked are stopped before this; they are not its to take.
    """
    pid = _fork_server_pid()
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def warm_up_in_background(preload: tuple[str, ...] = ()) -> Future[float]:
    """`warm_up` on a daemon thread: a node stopped during the imports exits at once, not after them.

    It leaves the late imports out: the caller asks for them (`import_late`) when the server is free.
    """
    done: Future[float] = Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():
            return  # the node stopped before the warm-up began
        # Running: a node stopping now cannot cancel it, so setting its result below never raises
        # (a cancelled future did: "Exception in thread gossamer-warm-up" in a stopped node's log).
        try:
            done.set_result(warm_up(preload, late=False))
        except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the future
            done.set_exception(e)

    threading.Thread(target=run, name="gossamer-warm-up", daemon=True).start()
    return done


def start_shared(state_dir: Path, preload: tuple[str, ...] = (), *,
                 wait: bool = True) -> tuple[subprocess.Popen[bytes], str]:
    """A zygote importing the role code and `preload`, for every node this session starts (`zygote.ENV`)."""
    # Not on a node's path to its first role (started once per host): imports everything before serving.
    return zygote.start(state_dir, (*ROLE_MODULES, *late_imports.LATE_MODULES, *preload), wait=wait)
