"""Submit-time import checks of an experiment's code paths: one child process per distinct set, cached, capped."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import sys
import time
from typing import NoReturn

from gossamer.core import zygote
from gossamer.core.errors import ConfigError, UnavailableError
from gossamer.core.experiment import Experiment
from gossamer.core.import_check import send_verdict

#: How long a failed check's verdict is reused (a fixed module is checked again after this).
FAILURE_TTL_S = 30.0
#: Seconds one check may take before it is killed (the submit is then queued unchecked).
TIMEOUT_S = 120.0

Key = tuple[tuple[str, str], ...]
log = logging.getLogger(__name__)


class TooManyChecks(UnavailableError):
    """More distinct import checks are waiting than the coordinator queues (UNAVAILABLE: retry later)."""


def import_paths(exp: Experiment) -> Key:
    """Every "module:callable" path of `exp` that a worker imports, as (field, path) pairs."""
    return tuple(exp.code_paths().items())


class ImportChecker:
    """Runs `gossamer.core.import_check` in a child interpreter, which imports (runs) user code.

    At most `concurrency` children run at once and at most `max_waiting` checks wait for
    one; identical submits in flight share one child; a success is cached for good and a
    failure for FAILURE_TTL_S. So a flood of submits costs at most `concurrency` processes.
    """

    def __init__(self, concurrency: int = 2, max_waiting: int = 64, timeout_s: float = TIMEOUT_S) -> None:
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self._slots = asyncio.Semaphore(concurrency)
        self._ok: set[Key] = set()
        self._failed: dict[Key, tuple[float, ConfigError]] = {}
        self._inflight: dict[Key, asyncio.Future[bool]] = {}
        self.spawned = 0  # child processes started (for tests and /metrics)

    async def check(self, exp: Experiment, code_dir: str = "") -> bool:
        """True if every import path of `exp` imports (with `code_dir`, its shipped workdir unpacked,
        first on the path); ConfigError naming the field if one does not; False if the check took
        over `timeout_s` (nothing known, nothing cached).

        A check that times out says nothing about the user's code: on a loaded host a valid
        submit's check took over 120 s and the submit was refused as if the code were wrong.
        """
        # The workdir's digest is part of the key: other shipped files are another verdict.
        key = import_paths(exp) + ((("workdir", exp.workdir),) if exp.workdir else ())
        if key in self._ok:
            return True
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < FAILURE_TTL_S:
            raise failed[1]
        pending = self._inflight.get(key)
        if pending is None:
            if len(self._inflight) >= self.concurrency + self.max_waiting:
                raise TooManyChecks(f"{len(self._inflight)} import checks are queued; submit again later")
            pending = asyncio.ensure_future(self._run(key, code_dir))
            self._inflight[key] = pending
            pending.add_done_callback(lambda _f, k=key: self._inflight.pop(k, None))  # type: ignore[misc]
        return await asyncio.shield(pending)

    def unchecked_note(self) -> str:
        """The event of an experiment queued without a verdict (its check timed out)."""
        return (f"importing its code took over {self.timeout_s:g} s here: queued unchecked; a worker that "
                "cannot import it fails the run saying why")

    async def _run(self, key: Key, code_dir: str) -> bool:
        args = [f"{field}={path}" for field, path in key if field != "workdir"]
        env = dict(os.environ)
        if code_dir:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (code_dir, env.get("PYTHONPATH", ""))))
        async with self._slots:
            self.spawned += 1
            if _warm():
                verdict = await asyncio.get_running_loop().run_in_executor(None, _warm_verdict, args, env,
                                                                           self.timeout_s)
            else:
                verdict = await _cold_verdict(args, env, self.timeout_s)
        if verdict is None:
            log.warning("import check of %s took over %g s: not judged", ", ".join(p for _, p in key), self.timeout_s)
            return False
        if verdict == "ok":
            self._ok.add(key)
            return True
        field, _, msg = verdict.partition(": ")
        fields = [f for f, _ in key if f != "workdir"]
        return self._fail(key, ConfigError(field if field in fields else fields[0], msg or verdict))

    def _fail(self, key: Key, error: ConfigError) -> NoReturn:
        self._failed[key] = (time.monotonic(), error)
        if len(self._failed) > 1024:  # bounded: forget the oldest verdicts
            for k in sorted(self._failed, key=lambda k: self._failed[k][0])[:512]:
                del self._failed[k]
        raise error


async def _cold_verdict(args: list[str], env: dict[str, str], timeout_s: float) -> str | None:
    """The verdict of a fresh interpreter (None: it took over `timeout_s` and was killed)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gossamer.core.import_check", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return out.decode().strip()


_adopted: bool | None = None


def _warm() -> bool:
    """Whether checks fork from this host's zygote (`gossamer.core.zygote`; torch already imported there)."""
    global _adopted
    if _adopted is None:
        path = os.environ.get(zygote.ENV)
        _adopted = zygote.adopt(path) if path else False
    return _adopted


def _warm_verdict(args: list[str], env: dict[str, str], timeout_s: float) -> str | None:
    """The verdict of a process forked from the zygote; blocks (run it in an executor)."""
    ctx = mp.get_context("forkserver")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=send_verdict, args=(args, send, env), name="gossamer-import-check", daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            return None
        return str(recv.recv())
    except EOFError:
        proc.join(5)
        return f"{args[0].partition('=')[0]}: the import check died (exit code {proc.exitcode}) importing it"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
