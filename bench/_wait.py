"""Polling wait and process reaping shared by the benches that drive real processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any


def wait(pred: Callable[[], Any], timeout: float, what: str, period: float = 0.1) -> Any:
    """Poll `pred` every `period` s until it returns something truthy, and return that; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(period)


def reap(procs: Iterable[Any], timeout: float = 30.0) -> None:
    """Join each process of a bench (multiprocessing), killing any still alive after `timeout` s."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
