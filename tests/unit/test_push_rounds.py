"""`push_rounds`: which rounds a sync push's messages go in, down to a rank with nothing to push."""

from __future__ import annotations

from typing import Any

import torch

from gossamer.paramserver.push_parts import push_rounds
from gossamer.transport.frames import Message


def _make(shard: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Message:
    return Message(op="PUSH", experiment="e", shard=shard, version=0, sender="w", meta=meta, tensors=tensors)


def test_a_rank_with_no_chunks_pushes_one_empty_round_and_nothing_in_parts() -> None:
    # A model of one chunk on a node of two local ranks: the second rank has no chunk of its own to push.
    assert push_rounds({}, _make) == ([{}], {})


def test_a_small_push_goes_whole_in_one_round() -> None:
    msg = _make(0, {"clock": 1}, {"c0": torch.zeros(4)})
    rounds, parted = push_rounds({0: msg}, _make, budget=1 << 20)
    assert rounds == [{0: msg}] and parted == {}
