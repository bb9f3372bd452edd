"""Data-plane limits and CURVE key checks as pure logic: rate buckets, size limits, header peeking, key format."""

from __future__ import annotations

import pytest

from gossamer.core.errors import ConfigError
from gossamer.security.curve import CurveKeyPair, CurveKeyring, check_public_key, keyring_from_spec
from gossamer.transport.frames import MIN_MESSAGE_BYTES, FrameLimits, Message, encode, peek_header
from gossamer.transport.ratelimit import PeerRateLimiter, RateLimit


def test_a_peer_gets_its_burst_then_the_rate_and_others_are_unaffected() -> None:
    limiter = PeerRateLimiter(RateLimit(messages_per_s=10, burst=5))
    assert [limiter.allow(b"a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert limiter.allow(b"b", 0.0)  # its own bucket
    assert not limiter.allow(b"a", 0.05)  # half a token refilled
    assert limiter.allow(b"a", 0.2)  # 1.5 tokens by now
    assert limiter.allow(b"a", 100.0) and limiter.refused == 2


def test_refused_peers_are_answered_at_most_once_per_interval() -> None:
    limiter = PeerRateLimiter(RateLimit(messages_per_s=1, burst=1, answer_every_s=1.0))
    limiter.allow(b"a", 0.0)
    assert not limiter.allow(b"a", 0.0)
    assert [limiter.answer(b"a", t) for t in (0.0, 0.5, 1.0, 1.2)] == [True, False, True, False]


def test_the_bucket_table_is_bounded() -> None:
    limiter = PeerRateLimiter(RateLimit(messages_per_s=1, burst=1), max_peers=3)
    for i in range(10):
        limiter.allow(bytes([i]), 0.0)
    assert len(limiter._buckets) == 3


@pytest.mark.parametrize(("kw", "field"), [({"messages_per_s": 0}, "messages_per_s"),
                                           ({"messages_per_s": float("inf")}, "messages_per_s"),
                                           ({"burst": 0}, "burst"), ({"answer_every_s": -1}, "answer_every_s")])
def test_bad_rate_limits_name_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RateLimit(**kw)  # type: ignore[arg-type]


def test_size_limits_follow_the_values_with_a_floor() -> None:
    header = FrameLimits().max_header_bytes
    assert FrameLimits.for_values(10).max_message_bytes == MIN_MESSAGE_BYTES
    assert FrameLimits.for_values(25_000_000).max_message_bytes == 4 * 4 * 25_000_000 + header
    assert FrameLimits.for_values(25_000_000, copies=2).max_message_bytes == 2 * 4 * 25_000_000 + header
    with pytest.raises(ConfigError):
        FrameLimits.for_values(-1)


def test_peek_header_reads_the_rid_and_never_raises() -> None:
    frames = encode(Message(op="PUSH", experiment="e", meta={"rid": 7}))
    head = peek_header(frames[0])
    assert head is not None and head["meta"]["rid"] == 7
    assert peek_header(b"\xc1garbage") is None
    assert peek_header(b"\x93\x01\x02\x03") is None  # a list, not a map
    assert peek_header(b"x" * 100, FrameLimits(max_header_bytes=10)) is None


def test_curve_keys_are_checked_and_the_keyring_follows_updates() -> None:
    pair = CurveKeyPair.generate()
    assert check_public_key(pair.public) == pair.public
    assert pair.secret not in repr(pair)
    for bad in ("", "x" * 39, "~" * 40, "\x00" * 40, "é" * 40):
        with pytest.raises(ConfigError, match="curve_public_key"):
            check_public_key(bad)
    assert keyring_from_spec({}) is None
    ring = keyring_from_spec({"curve_public": pair.public, "curve_secret": pair.secret,
                              "curve_members": [pair.public], "curve_server_keys": {"tcp://h:1": pair.public}})
    assert isinstance(ring, CurveKeyring)
    assert ring.is_member(pair.public) and not ring.is_member(None) and ring.server_key("tcp://h:1") == pair.public
    ring.update_from({"curve_members": [], "workers": ["ignored"]})
    assert not ring.is_member(pair.public) and ring.server_key("tcp://h:1") == pair.public
