"""UDP heartbeat wire format: golden bytes, and every malformed or forged datagram refused without an exception."""

from __future__ import annotations

import pathlib
import random

import pytest

from gossamer.transport import beat_wire
from gossamer.transport.beat_wire import Signer, parse_beat

DATA = pathlib.Path(__file__).parent.parent / "data"
KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


def test_a_beat_and_its_reply_are_the_pinned_bytes() -> None:
    signer = Signer(KEY)
    beat = signer.beat("node-a", 7)
    assert beat == (DATA / "beat_v1.bin").read_bytes()
    assert beat[:3] == bytes((beat_wire.VERSION, beat_wire.BEAT, 6)) and beat[3:9] == b"node-a"
    assert parse_beat(beat) == ("node-a", 7)
    assert signer.check_beat(beat)
    reply = signer.reply(7, known=True)
    assert reply == (DATA / "beat_reply_v1.bin").read_bytes()
    assert signer.check_reply(reply) == (7, True)
    assert signer.check_reply(signer.reply(2**64 - 1, known=False)) == (2**64 - 1, False)


def test_a_reply_is_never_larger_than_the_smallest_beat() -> None:
    smallest = Signer(KEY).beat("a", 1)
    assert len(smallest) == beat_wire.MIN_BEAT
    assert beat_wire.REPLY_SIZE < beat_wire.MIN_BEAT
    assert len(Signer(KEY).beat("n" * beat_wire.MAX_ID, 1)) == beat_wire.MAX_BEAT


@pytest.mark.parametrize("case", ["empty", "short", "long", "version", "kind", "length", "non-ascii"])
def test_malformed_beats_do_not_parse(case: str) -> None:
    good = bytearray(Signer(KEY).beat("node-a", 7))
    bad = {
        "empty": b"",
        "short": bytes(good[:-1]),
        "long": bytes(good) + b"\0",
        "version": bytes([2]) + bytes(good[1:]),
        "kind": bytes([good[0], beat_wire.KNOWN]) + bytes(good[2:]),
        "length": bytes(good[:2]) + bytes([7]) + bytes(good[3:]),
        "non-ascii": bytes(good[:3]) + "nöde-".encode("latin-1") + bytes(good[8:]),
    }[case]
    assert parse_beat(bad) is None


def test_a_forged_or_altered_beat_fails_its_mac() -> None:
    signer = Signer(KEY)
    beat = signer.beat("node-a", 7)
    assert not Signer(OTHER).check_beat(beat)  # another node's key
    for i in range(len(beat)):  # any bit flipped anywhere: id, counter or MAC
        altered = bytearray(beat)
        altered[i] ^= 0x01
        assert not signer.check_beat(bytes(altered))


def test_replies_are_refused_unless_under_the_key_and_in_the_reply_layout() -> None:
    signer = Signer(KEY)
    assert Signer(OTHER).check_reply(signer.reply(7, known=True)) is None
    assert signer.check_reply(signer.beat("node-a", 7)) is None  # a beat is not a reply
    reply = bytearray(signer.reply(7, known=True))
    reply[1] = beat_wire.UNKNOWN  # "known" turned into "unknown" by someone without the key
    assert signer.check_reply(bytes(reply)) is None
    assert signer.check_reply(bytes(reply[:-1])) is None


def test_random_datagrams_never_raise() -> None:
    rng = random.Random(18)
    signer = Signer(KEY)
    for _ in range(3000):
        size = rng.choice([rng.randrange(0, 120), beat_wire.MIN_BEAT, beat_wire.REPLY_SIZE, 33])
        data = bytes(rng.randrange(256) for _ in range(size))
        if rng.random() < 0.5 and size >= 3:  # mostly well-formed headers, so the parser goes deep
            data = bytes((beat_wire.VERSION, beat_wire.BEAT, max(1, size - 27) % 256)) + data[3:]
        parsed = parse_beat(data)
        assert parsed is None or (isinstance(parsed[0], str) and not signer.check_beat(data))
        assert signer.check_reply(data) is None


def test_a_key_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        Signer(b"short")
    with pytest.raises(ValueError, match="node id"):
        Signer(KEY).beat("", 1)
