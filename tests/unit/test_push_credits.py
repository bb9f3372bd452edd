"""Push credits as pure bookkeeping: who may send a large push, in what order, and what is taken back."""

from __future__ import annotations

import random

import pytest
import torch

from gossamer.paramserver.push_credits import CreditAsker, PushCredits
from gossamer.transport.frames import Message

MIB = 1 << 20


def _members(_: str) -> bool:
    return True


def test_one_push_of_the_budget_at_a_time_first_come_first_granted() -> None:
    c = PushCredits(64 * MIB)
    assert c.ask(b"a", "a", 1, 64 * MIB, 0.0) == [(b"a", 1)]
    assert c.ask(b"b", "b", 7, 64 * MIB, 0.1) == []
    assert c.ask(b"c", "c", 9, 64 * MIB, 0.2) == []
    assert c.waiting() == 2 and c.waited == 2
    assert c.pushed(b"a", 1.0) == [(b"b", 7)]
    assert c.pushed(b"b", 2.0) == [(b"c", 9)]
    assert c.pushed(b"c", 3.0) == []
    assert c.peak_granted_bytes == 64 * MIB


def test_smaller_pushes_share_the_budget_and_a_larger_one_goes_alone() -> None:
    c = PushCredits(64 * MIB)
    assert c.ask(b"a", "a", 1, 30 * MIB, 0.0) == [(b"a", 1)]
    assert c.ask(b"b", "b", 2, 30 * MIB, 0.0) == [(b"b", 2)]
    assert c.ask(b"big", "big", 3, 200 * MIB, 0.0) == []  # over what is left
    assert c.ask(b"d", "d", 4, 1 * MIB, 0.0) == []  # behind the big one: first come, first granted
    assert c.pushed(b"a", 1.0) == []
    assert c.pushed(b"b", 1.0) == [(b"big", 3)]  # nothing else granted: one always goes
    assert c.pushed(b"big", 2.0) == [(b"d", 4)]


def test_a_resend_keeps_its_place_and_a_granted_resend_is_granted_again() -> None:
    c = PushCredits(10)
    c.ask(b"a", "a", 1, 10, 0.0)
    c.ask(b"b", "b", 2, 10, 0.0)
    c.ask(b"c", "c", 3, 10, 0.0)
    assert c.ask(b"b", "b", 5, 10, 0.5) == []  # asked again under a new rid: still second
    assert c.waited == 2
    assert c.ask(b"a", "a", 6, 10, 0.6) == [(b"a", 6)]  # its grant, renewed under the new rid
    assert c.pushed(b"a", 1.0) == [(b"b", 5)]


def test_an_unused_grant_is_taken_back_after_the_timeout_and_a_gone_worker_s_at_once() -> None:
    c = PushCredits(10, grant_timeout_s=30.0)
    c.ask(b"a", "a", 1, 10, 0.0)
    c.ask(b"b", "b", 2, 10, 0.0)
    c.ask(b"c", "c", 3, 10, 0.0)
    assert c.expire(29.0, _members) == []
    assert c.expire(30.5, _members) == [(b"b", 2)]
    assert c.expired == 1
    # b's worker left: its grant goes, and c's request is granted without waiting for a timeout.
    assert c.expire(31.0, lambda s: s != "b") == [(b"c", 3)]
    assert c.expired == 1
    assert c.pushed(b"a", 32.0) == []  # a's grant was taken back: its late push frees nothing


def test_requests_beyond_the_queue_are_refused_and_none_is_kept() -> None:
    c = PushCredits(10, max_waiting=3)
    c.ask(b"g", "g", 0, 10, 0.0)
    for i in range(3):
        c.ask(bytes([i]), str(i), i, 10, 0.0)
    with pytest.raises(OverflowError):
        c.ask(b"x", "x", 9, 10, 0.0)
    assert c.refused == 1 and c.waiting() == 3
    c.ask(bytes([1]), "1", 11, 10, 0.0)  # one already waiting may ask again


def test_random_traffic_never_grants_more_than_the_budget_or_one_push() -> None:
    rng = random.Random(5)
    budget = 100
    c = PushCredits(budget, grant_timeout_s=5.0)
    granted: dict[bytes, int] = {}
    sizes: dict[bytes, int] = {}
    now = 0.0
    for _ in range(5000):
        now += rng.random()
        who = bytes([rng.randrange(12)])
        op = rng.random()
        if op < 0.5:
            sizes[who] = rng.choice([10, 40, 90, 150])
            grants = c.ask(who, who.hex(), rng.random(), sizes[who], now)
        elif op < 0.95:
            grants = c.pushed(who, now)
            granted.pop(who, None)
        else:
            grants = c.expire(now, lambda s: s != "05")
        for identity, _ in grants:
            granted[identity] = sizes[identity]
        assert c.granted_bytes <= budget or c.granted_count == 1, (c.granted_bytes, c.granted_count)
        assert sum(granted.get(i, 0) for i in granted) >= c.granted_bytes
    assert c.waited > 100


def _push(nbytes: int, rid: int) -> Message:
    return Message(op="PUSH", experiment="e", shard=0, sender="w", meta={"rid": rid, "auth": "t", "clock": 3},
                   tensors={"0": torch.zeros(nbytes // 4)})


def test_the_worker_asks_for_a_large_push_once_per_send() -> None:
    asker = CreditAsker(min_bytes=1024)
    small = _push(512, 1)
    assert asker.to_send(0, small) is small
    big = _push(4096, 2)
    ask = asker.to_send(0, big)
    assert ask.op == "CREDIT" and ask.tensors == {} and ask.meta == {"nbytes": 4096, "rid": 2, "auth": "t"}
    assert asker.to_send(0, big).op == "CREDIT"  # not granted yet: a resend asks again
    asker.granted(0, 2)
    assert asker.to_send(1, big).op == "CREDIT"  # another shard's grant is its own
    assert asker.to_send(0, big) is big
    assert asker.to_send(0, big).op == "CREDIT"  # the grant was used up by that send
    asker.granted(0, 1)  # a stale grant (an older rid) does not let this push go
    assert asker.to_send(0, big).op == "CREDIT"
    assert asker.asked == 5


def test_what_the_server_still_holds_of_read_pushes_counts_against_the_budget() -> None:
    """A primary still holds an applied push for its backup (waiting for the window, or not yet let go of by
    libzmq): the next push is granted once that is gone, not beside it."""
    c = PushCredits(64 * MIB)
    c.reserved = 64 * MIB
    assert c.ask(b"a", "a", 1, 64 * MIB, 0.0) == []
    assert c.regrant(0.1) == []
    c.reserved = 0
    assert c.regrant(0.2) == [(b"a", 1)]
    c.reserved = 10 * MIB  # a small part held: a push within what is left still goes
    assert c.ask(b"b", "b", 2, 1 * MIB, 0.3) == []  # not beside a's 64 MiB grant
    assert c.pushed(b"a", 0.4) == [(b"b", 2)]
