"""A train function's sync push: the gradients and values of parameters cut across chunks, and the mean written back."""

from __future__ import annotations

import torch
from torch import nn

from gossamer.engine.shard_plan import ShardPlan
from gossamer.training.train_function import _from_chunks, _into_chunks, _segments


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 1))


def test_parameters_cut_across_chunks_and_shards_go_in_and_come_back_whole() -> None:
    model = _model()
    params = list(model.parameters())
    plan = ShardPlan.for_module(model, num_shards=2, chunk_numel=9)  # small chunks: parameters span several
    assert len(plan.chunks) > len(params)
    segments = _segments(params, plan.chunks)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    grads = [torch.randn_like(p) for p in params]
    flat_grads = torch.cat([g.reshape(-1) for g in grads])
    pushed = {c.index: torch.full((2 * c.numel,), float("nan")) for c in plan.chunks}
    _into_chunks([grads, params], segments, pushed)
    for c in plan.chunks:  # each chunk holds its stretch of the gradients then of the parameters, every value written
        assert torch.equal(pushed[c.index][:c.numel], flat_grads[c.flat_offset:c.flat_offset + c.numel])
        assert torch.equal(pushed[c.index][c.numel:], flat[c.flat_offset:c.flat_offset + c.numel])
    chunks = {i: v[len(v) // 2:] for i, v in pushed.items()}
    for k, p in enumerate(params):
        out = torch.full((p.numel(),), float("nan"))
        _from_chunks(chunks, segments[k], out)
        assert torch.equal(out, p.detach().reshape(-1))


def test_a_missing_gradient_goes_as_zeros_and_a_missing_chunk_comes_back_as_zeros() -> None:
    model = _model()
    params = list(model.parameters())
    plan = ShardPlan.for_module(model, num_shards=1, chunk_numel=9)
    segments = _segments(params, plan.chunks)
    chunks = {c.index: torch.full((c.numel,), float("nan")) for c in plan.chunks}
    _into_chunks([[None] * len(params)], segments, chunks)
    assert all(bool((v == 0).all()) for v in chunks.values())
    first = plan.chunks[0]
    _into_chunks([params], segments, chunks)
    del chunks[first.index]
    out = torch.full((params[0].numel(),), float("nan"))
    _from_chunks(chunks, segments[0], out)
    flat0 = params[0].detach().reshape(-1)
    assert bool((out[:first.numel] == 0).all()) and torch.equal(out[first.numel:], flat0[first.numel:])
