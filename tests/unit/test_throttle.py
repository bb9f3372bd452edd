"""The token bucket holds senders to the configured rate and can be re-rated mid-run."""

from __future__ import annotations

import time

import pytest

from gossamer.core.errors import ConfigError
from gossamer.transport.throttle import TokenBucket, parse_bandwidth


def test_rate_is_enforced_over_time() -> None:
    bucket = TokenBucket(rate_bps=1_000_000, burst_bytes=10_000)
    t0 = time.monotonic()
    for _ in range(20):
        bucket.consume(10_000)  # 200 kB at 1 MB/s: about 0.19 s after the burst
    assert time.monotonic() - t0 >= 0.17


def test_unlimited_never_sleeps_and_rate_can_change() -> None:
    bucket = TokenBucket(rate_bps=None)
    assert sum(bucket.consume(10**7) for _ in range(5)) == 0.0
    bucket.set_rate(1e6)
    assert bucket.consume(200_000) > 0.1
    bucket.set_rate(None)
    assert bucket.consume(10**7) == 0.0


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("100mbit") == pytest.approx(12.5e6)
    assert parse_bandwidth("1gbit") == pytest.approx(125e6)
    assert parse_bandwidth("2MB") == 2e6
    for bad in ("fast", "-1mbit", "0mb"):
        with pytest.raises(ConfigError):
            parse_bandwidth(bad)
