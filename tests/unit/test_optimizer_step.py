"""A shard's optimizer step (`optimizer.step`): torch's SGD through its functional form, the same bits as `SGD.step()`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gossamer.paramserver._copy_on_write import WritesAside, storage_of
from gossamer.paramserver.optimizer import step

SETTINGS: list[dict[str, Any]] = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"momentum": 0.5, "dampening": 0.1, "weight_decay": 0.1},
]


def _run(settings: dict[str, Any], stepper: Any, steps: int = 6) -> tuple[list[torch.Tensor], torch.optim.SGD]:
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(n, generator=gen) for n in (1, 17, 1000)] + [torch.randn(3, 40, generator=gen)]
    opt = torch.optim.SGD(params, lr=0.03, **settings)
    for i in range(steps):
        for k, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen) * (10.0 ** (k % 3 - 1))
        if i == 3:
            params[1].grad = None  # a chunk not in this step's group
        stepper(opt)
    return params, opt


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_same_values_and_momentum_bits_as_sgd_step(settings: dict[str, Any]) -> None:
    want, ref = _run(settings, lambda o: o.step())
    got, opt = _run(settings, step)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g), (w - g).abs().max()
        if settings.get("momentum"):
            assert torch.equal(ref.state[w]["momentum_buffer"], opt.state[g]["momentum_buffer"])


def test_hooks_are_honoured() -> None:
    # A hook on the optimizer means Optimizer.step: the functional form would skip it.
    seen: list[int] = []
    p = torch.zeros(4)
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    opt.register_step_post_hook(lambda *_: seen.append(1))
    for _ in range(3):
        p.grad = torch.ones(4)
        step(opt)
    assert seen == [1, 1, 1]


def test_writes_aside_sees_the_writes_of_the_functional_form() -> None:
    # A send still reads the values: the step writes them out of place, the lent storage is untouched.
    p = torch.ones(64)
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    p.grad = torch.ones(64)
    step(opt)  # the first step makes the momentum buffer
    before = p.detach().clone()
    lent = p.detach()
    p.grad = torch.ones(64)
    with WritesAside({storage_of(p)}):
        step(opt)
    assert torch.equal(lent, before)  # what the reply reads
    assert not torch.equal(p, before)  # the parameter moved on, in new memory


def test_a_group_without_momentum_buffers_yet_steps_every_group_once() -> None:
    # Two groups, the second added after a step: its first step goes through SGD.step for all groups, and the
    # first group is not stepped twice.
    def run(stepper: Any) -> list[torch.Tensor]:
        a, b = torch.ones(8), torch.ones(8)
        opt = torch.optim.SGD([a], lr=0.5, momentum=0.9)
        a.grad = torch.ones(8)
        stepper(opt)
        opt.add_param_group({"params": [b]})
        for _ in range(2):
            a.grad, b.grad = torch.ones(8), torch.ones(8)
            stepper(opt)
        return [a, b]

    for w, g in zip(run(lambda o: o.step()), run(step), strict=True):
        assert torch.equal(w, g)
