"""What encoded replication relies on: a push decodes to the same bits every time, and decoding leaves its payload
as it arrived (the primary forwards that payload after decoding it, and its backup decodes it again)."""

from __future__ import annotations

import pytest
import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.paramserver import ShardPlan


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "qsgd:4", "topk:0.05", "randk:0.05",
                                   "powersgd:2", "sign"])
def test_every_codec_decodes_a_push_to_the_same_bits_twice_and_leaves_its_payload_unchanged(codec: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    plan = ShardPlan.for_module(model, 1, chunk_numel=1024)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    encoder = ChunkCompressor(codec, plan, shapes=shapes, seed=3)
    g = torch.Generator().manual_seed(1)
    for c in plan.chunks:
        tensors, meta = encoder.encode(c.index, torch.randn(c.numel, generator=g))
        sent = {n: t.clone() for n, t in tensors.items()}
        # A primary's and its backup's decoders: separate instances, as in two processes.
        first = ChunkCompressor(codec, plan, shapes=shapes).decode(c.index, tensors, meta)
        second = ChunkCompressor(codec, plan, shapes=shapes).decode(c.index, tensors, meta)
        assert torch.equal(first, second)
        assert first.data_ptr() not in {t.data_ptr() for t in tensors.values()}  # a buffer of its own
        for name, t in tensors.items():
            assert torch.equal(t, sent[name]), name
        first.add_(1.0)  # the primary sums into its decoded buffer: the payload must not see it
        for name, t in tensors.items():
            assert torch.equal(t, sent[name]), name
