"""Sign leaves a parameter of dim < 2 (bias, norm gain) uncompressed when its shape is known, on both ends."""

from __future__ import annotations

import pytest
import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.compression.worker_momentum import WorkerMomentum
from gossamer.core.errors import ProtocolError
from gossamer.engine.shard_plan import ShardPlan

PLAN = ShardPlan.build([("w", 12), ("b", 3), ("g", 3)], num_shards=1, chunk_numel=1 << 20)
SHAPES = {"w": (4, 3), "b": (3,), "g": (3,)}


def test_sign_sends_vectors_as_none_and_the_matrix_as_signs() -> None:
    enc = ChunkCompressor("sign", PLAN, shapes=SHAPES, momentum=WorkerMomentum(0.9))
    assert enc.codecs() == {"w": "sign", "b": "none", "g": "none"}
    x = torch.tensor([0.5, -1.0, 2.0, -0.25, 3.0, -3.0, 1.0, 1.0, -1.0, 0.1, -0.2, 0.3, 1e-3, -2e-3, 5.0, 0.7, -0.7, 0.01])
    tensors, meta = enc.encode(0, x)
    # The two vectors are adjacent with one elementwise codec: one fp32 segment after the matrix's signs.
    assert [(s["param"], s["codec"], s["numel"]) for s in meta["segments"]] == [("w", "sign", 12), ("b", "none", 6)]
    dec = ChunkCompressor("sign", PLAN, shapes=SHAPES)  # a shard: no momentum, the same shapes
    got = dec.decode(0, tensors, meta)
    assert torch.equal(got[12:], x[12:])  # first step: the velocity is the gradient, sent exactly
    assert not torch.equal(got[:12], x[:12]) and got[:12].abs().unique().numel() == 1  # +-scale
    # No error feedback for what went exactly: the residual of the vectors is zero.
    assert torch.equal(enc.feedback.residual("c0")[12:], torch.zeros(6))
    # Momentum still runs on the vectors (worker momentum SGD): step 2 sends g + 0.9 g.
    tensors, meta = enc.encode(0, x)
    assert torch.allclose(dec.decode(0, tensors, meta)[12:], 1.9 * x[12:])


def test_the_rule_follows_the_codec_an_override_picks_and_needs_the_shapes_on_both_ends() -> None:
    enc = ChunkCompressor("none", PLAN, shapes=SHAPES, overrides=[("b", "sign"), ("w", "int8")])
    assert enc.codecs() == {"w": "int8", "b": "none", "g": "none"}
    # Without the shapes every parameter is 1-D to the compressor: sign goes on every one.
    blind = ChunkCompressor("sign", PLAN)
    assert blind.codecs() == {"w": "sign", "b": "sign", "g": "sign"}
    tensors, meta = ChunkCompressor("sign", PLAN, shapes=SHAPES).encode(0, torch.ones(18))
    with pytest.raises(ProtocolError):
        blind.decode(0, tensors, meta)
