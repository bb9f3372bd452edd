"""A token-bucket bandwidth limit on outgoing bytes (emulates a slow link; also a send-rate cap)."""

from __future__ import annotations

import threading
import time

from gossamer.core.errors import ConfigError


class TokenBucket:
    """Blocks senders so that, over time, at most `rate_bps` bytes/s leave.

    `rate_bps=None` means unlimited. The rate can be changed at any time (thread-safe), so
    a test or a fault injector can throttle a link mid-run and lift the limit later.
    """

    def __init__(self, rate_bps: float | None = None, burst_bytes: int = 64 * 1024) -> None:
        if burst_bytes <= 0:
            raise ConfigError("burst_bytes", "must be > 0")
        self._lock = threading.Lock()
        self._burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._last = time.monotonic()
        self._rate: float | None = None
        self.set_rate(rate_bps)
        self.waited_s = 0.0

    @property
    def rate_bps(self) -> float | None:
        return self._rate

    def set_rate(self, rate_bps: float | None) -> None:
        if rate_bps is not None and rate_bps <= 0:
            raise ConfigError("rate_bps", f"must be > 0 or None, got {rate_bps!r}")
        with self._lock:
            self._refill()
            self._rate = rate_bps

    def _refill(self) -> None:
        now = time.monotonic()
        if self._rate is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        else:
            self._tokens = self._burst
        self._last = now

    def consume(self, nbytes: int) -> float:
        """Take `nbytes` tokens, sleeping until the bucket allows it; returns seconds slept."""
        with self._lock:
            self._refill()
            self._tokens -= nbytes
            deficit = -self._tokens
            rate = self._rate
        if rate is None or deficit <= 0:
            return 0.0
        delay = deficit / rate
        time.sleep(delay)
        self.waited_s += delay
        return delay


def parse_bandwidth(spec: str) -> float:
    """'100mbit' / '1gbit' / '12.5MB' / '800kbit' -> bytes per second."""
    s = spec.strip().lower()
    units = {
        "gbit": 1e9 / 8,
        "mbit": 1e6 / 8,
        "kbit": 1e3 / 8,
        "gb": 1e9,
        "mb": 1e6,
        "kb": 1e3,
        "b": 1.0,
    }
    for unit, factor in units.items():
        if s.endswith(unit):
            try:
                value = float(s[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * factor
            break
    raise ConfigError("bandwidth", f"expected e.g. '100mbit' or '12.5MB', got {spec!r}")
