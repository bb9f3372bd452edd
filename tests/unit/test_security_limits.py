"""Per-peer token buckets: bursts are capped, tokens refill at the rate, idle peers are forgotten."""

from __future__ import annotations

import pytest

from gossamer.security.limits import PeerBuckets, peer_host


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_burst_then_refused_then_refilled_at_the_rate() -> None:
    clock = _Clock()
    b = PeerBuckets(rate=10, burst=5, clock=clock)
    assert [b.allow("a") for _ in range(6)] == [True] * 5 + [False]
    clock.t += 0.15  # one token back (and half of the next)
    assert b.allow("a") and not b.allow("a")
    clock.t += 10  # never more than the burst
    assert sum(b.allow("a") for _ in range(20)) == 5


def test_each_peer_has_its_own_bucket() -> None:
    b = PeerBuckets(rate=1, burst=2, clock=_Clock())
    assert b.allow("a") and b.allow("a") and not b.allow("a")
    assert b.allow("b") and b.allow("b") and not b.allow("b")


def test_idle_peers_are_forgotten_beyond_max_peers() -> None:
    clock = _Clock()
    b = PeerBuckets(rate=10, burst=10, max_peers=100, clock=clock)
    for i in range(100):
        b.allow(f"10.0.0.{i}")
    clock.t += 5  # all of them refilled: they carry no state worth keeping
    b.allow("new")
    assert len(b) <= 2
    # a busy peer is kept, its empty bucket with it
    for _ in range(10):
        b.allow("busy")
    for i in range(101):
        b.allow(f"10.1.0.{i}")
    assert not b.allow("busy")


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError):
        PeerBuckets(rate=0, burst=1)
    with pytest.raises(ValueError):
        PeerBuckets(rate=1, burst=0)


@pytest.mark.parametrize("peer, host", [("ipv4:10.0.0.1:5000", "10.0.0.1"), ("ipv6:[::1]:43210", "::1"),
                                        ("ipv6:[fe80::1%eth0]:1", "fe80::1%eth0"), ("unix:/tmp/s", "unix:/tmp/s")])
def test_peer_host_drops_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host
