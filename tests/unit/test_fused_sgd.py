"""A large shard's SGD (`FusedSGD`): torch's fused kernel, the same bits as per-tensor SGD."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gossamer.paramserver._copy_on_write import WritesAside, storage_of
from gossamer.paramserver.optimizer import (
    FOREACH_MAX_NUMEL,
    FusedSGD,
    OptimizerConfig,
    build_optimizer,
)

pytestmark = pytest.mark.skipif(not FusedSGD.supported([torch.zeros(1)]), reason="this torch has no fused CPU SGD")

# Sizes around the fused kernel's 16-value unit, and one with a tail inside a large tensor.
SIZES = (1, 15, 16, 17, 31, 1000, 65_536 + 7)
SETTINGS: list[dict[str, Any]] = [
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"momentum": 0.5, "dampening": 0.1, "weight_decay": 0.1},
]


def _run(cls: type[torch.optim.SGD], settings: dict[str, Any], steps: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=gen) for n in SIZES] + [torch.randn(3, 40, generator=gen)]
    opt = cls(params, lr=0.03, foreach=False, **settings)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen) * (10.0 ** (i % 3 - 1))
        if step == 2:
            params[1].grad = None  # a chunk not in this group of the step
        opt.step()
    return params


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_same_bits_as_per_tensor_sgd(settings: dict[str, Any]) -> None:
    want = _run(torch.optim.SGD, settings)
    got = _run(FusedSGD, settings)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g), (w - g).abs().max()


def test_the_fused_kernel_alone_would_differ_in_a_tail() -> None:
    # Why FusedSGD steps the last (numel % 16) values per tensor: if this torch's fused kernel
    # gave per-tensor bits everywhere, the split would be unneeded (and this test would say so).
    gen = torch.Generator().manual_seed(0)
    diffs = 0
    for _ in range(20):
        values, grad, buf = (torch.randn(1_000_003, generator=gen) for _ in range(3))
        a, b, ba, bb = values.clone(), values.clone(), buf.clone(), buf.clone()
        torch._fused_sgd_([a], [grad], [ba], weight_decay=0.0, momentum=0.9, lr=0.01, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)
        ref = torch.optim.SGD([b], lr=0.01, momentum=0.9, foreach=False)
        ref.state[b]["momentum_buffer"] = bb
        b.grad = grad
        ref.step()
        assert torch.equal(a[:-3], b[:-3])
        diffs += int((a[-3:] != b[-3:]).sum())
    if diffs == 0:
        pytest.skip("this torch's fused kernel has the per-tensor bits in its tail too")


def test_under_writes_aside_a_frozen_value_keeps_its_bits_and_the_step_is_the_same() -> None:
    want = _run(torch.optim.SGD, SETTINGS[0], steps=2)
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=gen) for n in SIZES] + [torch.randn(3, 40, generator=gen)]
    opt = FusedSGD(params, lr=0.03, foreach=False, momentum=0.9)
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen) * (10.0 ** (i % 3 - 1))
        if step == 0:
            opt.step()
            continue
        held = params[-2]  # a reader still sends these values
        before = held.clone()
        lent = held.view(-1)[:]  # the reader's view of the old storage
        with WritesAside({storage_of(held)}) as mode:
            opt.step()
        assert mode.moved + mode.copies >= 1
        assert torch.equal(lent, before)  # the reader's values untouched
    for w, g in zip(want, params, strict=True):
        assert torch.equal(w, g)


def test_state_dict_round_trips_into_per_tensor_sgd() -> None:
    params = _run(FusedSGD, SETTINGS[1], steps=3)
    opt = FusedSGD(params, lr=0.03, foreach=False, **SETTINGS[1])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    plain = torch.optim.SGD([p.clone() for p in params], lr=0.03, foreach=False, **SETTINGS[1])
    plain.load_state_dict(opt.state_dict())
    assert all(torch.equal(plain.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
               for p, q in zip(params, plain.param_groups[0]["params"], strict=True))


def test_build_optimizer_takes_it_for_a_large_shard_with_momentum_only() -> None:
    big = [torch.empty(FOREACH_MAX_NUMEL // 2 + 1), torch.empty(FOREACH_MAX_NUMEL // 2)]
    assert type(build_optimizer(OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), big)) is FusedSGD
    assert type(build_optimizer(OptimizerConfig(name="sgd", lr=0.1), big)) is torch.optim.SGD
    assert type(build_optimizer(OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), [torch.zeros(10)])) \
        is torch.optim.SGD
    assert type(build_optimizer(OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), [t.half() for t in big])) \
        is torch.optim.SGD


def test_a_torch_without_the_fused_cpu_kernel_gets_per_tensor_sgd(monkeypatch: pytest.MonkeyPatch) -> None:
    from gossamer.paramserver import optimizer

    def cuda_only(*args: Any, **kwargs: Any) -> None:  # as torch 2.3's op answers CPU tensors
        raise RuntimeError("_fused_sgd_: not implemented for 'CPU'")

    big = [torch.empty(FOREACH_MAX_NUMEL // 2 + 1), torch.empty(FOREACH_MAX_NUMEL // 2)]
    optimizer._fused_cpu_sgd.cache_clear()
    monkeypatch.setattr(torch, "_fused_sgd_", cuda_only)
    try:
        assert not FusedSGD.supported(big)
        assert type(build_optimizer(OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), big)) is torch.optim.SGD
    finally:
        optimizer._fused_cpu_sgd.cache_clear()
