"""A data-plane ROUTER's send queue: deep enough for every small answer once its large replies are budgeted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from gossamer.transport.frames import FrameLimits
from gossamer.transport.outgoing import OutgoingReplies, ReplyBudget
from gossamer.transport.router import BUDGETED_SEND_DEPTH, Router, queue_depth

LIMITS = FrameLimits(max_message_bytes=64 << 20)  # a large model's messages: queue_depth's floor of 4


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def _depth(ctx: zmq.Context, **kwargs: object) -> int:
    router = Router(ctx, name="test", limits=LIMITS, refusal_reply=lambda *a: None, **kwargs)  # type: ignore[arg-type]
    try:
        return int(router.socket.getsockopt(zmq.SNDHWM))
    finally:
        router.close()


def test_a_router_with_a_reply_budget_queues_small_answers_to_the_budgeted_depth(ctx: zmq.Context) -> None:
    # The gossip peer's case: its snapshots are held against the budget, its ACKs and refusals
    # are small; a burst of 100 refusals to a peer that reads them all must not overflow.
    outgoing = OutgoingReplies(ReplyBudget(), 1 << 20)
    assert _depth(ctx, outgoing=outgoing) == BUDGETED_SEND_DEPTH >= 1000


def test_a_router_without_a_budget_queues_by_its_largest_message(ctx: zmq.Context) -> None:
    assert _depth(ctx) == queue_depth(LIMITS) == 4


def test_an_explicit_send_depth_is_kept(ctx: zmq.Context) -> None:
    assert _depth(ctx, outgoing=OutgoingReplies(ReplyBudget(), 1 << 20), send_depth=16) == 16
