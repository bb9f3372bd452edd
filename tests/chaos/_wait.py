"""Waits shared by the chaos tests: on a condition, on the run's progress, and checks that a fault landed mid-run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_GOING = ("queued", "starting", "running")


def wait_for(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll `pred` until it is truthy; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def wait_for_line(log: Path, text: str, timeout_s: float) -> None:
    """Wait until a process's log file holds `text` (what it said, not a guess at when it said it)."""
    wait_for(lambda: text in (log.read_text(errors="replace") if log.exists() else ""), timeout_s,
             f"{text!r} in {log}", interval=0.05)


def wait_steps(job: Any, steps: int, timeout: float, what: str, interval: float = 0.1) -> dict[str, Any]:
    """Wait until `job` has made `steps` steps; its status then.

    Fails if the run ends (or reaches its total) first: a fault timed by this wait must land
    while the run is still going, so a run that outpaces its trace is an error, not a pass.
    """
    deadline = time.monotonic() + timeout
    while True:
        st = job.status()
        assert st["state"] in _GOING and st["steps"] < st["total_steps"], f"the run ended before {what}: {st}"
        if st["steps"] >= steps:
            return st
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
        time.sleep(interval)


def wait_event(job: Any, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str,
               interval: float = 0.1) -> dict[str, Any]:
    """Wait until the coordinator's event log of `job` holds an event matching `pred`; that event."""
    deadline = time.monotonic() + timeout
    while True:
        hit = next((e for e in job.events() if pred(e)), None)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {job.status()}"
        time.sleep(interval)


def assert_running(job: Any, what: str) -> dict[str, Any]:
    """`job`'s status, after checking the run is still going (not finished, steps short of its total)."""
    st = job.status()
    assert st["state"] == "running" and st["steps"] < st["total_steps"], f"{what} landed after the run: {st}"
    return st
