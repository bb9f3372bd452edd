"""Polling helper shared by the chaos tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll `pred` until it is truthy; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
