"""The reply budget's accounting: a cap per connection, buffers of values counted once and free while current."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gossamer.core.errors import ConfigError
from gossamer.transport.outgoing import OutgoingReplies, ReplyBudget


@dataclass
class _Tracker:
    done: bool = False


def test_a_connection_holding_its_cap_of_unread_replies_is_refused_until_one_leaves() -> None:
    out = OutgoingReplies(ReplyBudget(per_peer=2, max_bytes=1 << 30), reply_bytes=100)
    first, second = _Tracker(), _Tracker()
    out.add(b"a", [first], 100, None)
    assert out.refusal(b"a") is None
    out.add(b"a", [second], 100, None)
    assert "per_peer" in (out.refusal(b"a") or "")
    assert out.refusal(b"b") is None  # another connection is not held back by it
    first.done = True
    assert out.refusal(b"a") is None and out.held_replies(b"a") == 1


def test_replies_of_the_current_values_cost_nothing_and_an_old_buffer_counts_once() -> None:
    out = OutgoingReplies(ReplyBudget(per_peer=8, max_bytes=250), reply_bytes=100)
    for peer in (b"a", b"b", b"c"):
        out.add(peer, [_Tracker()], 100, shared=1)  # all reference buffer 1
    assert out.held_bytes(live={1}) == 0  # still the shard's values
    assert out.held_bytes(live={2}) == 100  # a write moved the values: buffer 1 is extra, once
    out.add(b"d", [_Tracker()], 100, shared=None)  # compressed differences: its own buffer
    out.add(b"e", [_Tracker()], 100, shared=None)
    assert out.held_bytes(live={2}) == 300
    assert "max_bytes" in (out.refusal(b"f", live={2}) or "")
    assert out.refusal(b"f", live={1}) is None  # 200 < 250 while buffer 1 is current


def test_budget_fields_are_validated_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="per_peer"):
        ReplyBudget(per_peer=0)
    with pytest.raises(ConfigError, match="max_bytes"):
        ReplyBudget(max_bytes=0)
    assert OutgoingReplies(ReplyBudget(), reply_bytes=1 << 20).max_bytes == 64 << 20
    assert OutgoingReplies(ReplyBudget(), reply_bytes=100 << 20).max_bytes == 800 << 20
