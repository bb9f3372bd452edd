"""A pull difference that overflows fp32 goes as whole values, never as an internal error (PullViews)."""

from __future__ import annotations

import torch

from gossamer.core.protocol import chunk_key
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver._pull_views import PullViews


def test_an_overflowing_difference_is_sent_whole_and_becomes_the_view() -> None:
    plan = ShardPlan.build([("w", 8)], num_shards=1, chunk_numel=1 << 20)
    views = PullViews(plan, {"w": (8,)})
    views.note_codec(b"id", "w0", "int8")
    big = float(torch.finfo(torch.float32).max)
    params = {0: torch.full((8,), -big)}
    meta, tensors, _ = views.reply(b"id", [0], params, done=False)  # first contact: whole values
    assert meta.pull_compression is None and torch.equal(tensors[chunk_key(0)], params[0])
    params[0] = torch.full((8,), big)  # big - (-big) is +inf in fp32: int8 cannot encode it
    meta, tensors, _ = views.reply(b"id", [0], params, done=False)
    assert meta.pull_compression is None and torch.equal(tensors[chunk_key(0)], params[0])
    params[0] = params[0] - 1e32  # a finite difference again: compressed against the new view
    meta, tensors, _ = views.reply(b"id", [0], params, done=False)
    assert meta.pull_compression is not None and meta.codec == "int8"
