"""bench/_straggler.py: the WAN bench's slow host computes the same gradients, padded by (F - 1) x its own compute."""

from __future__ import annotations

import pytest
import torch

from bench._straggler import ENV, mlp, slowdown
from gossamer.examples.digits import mlp as plain_mlp


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_same_network_same_gradients_and_padding_is_f_minus_1_times_compute() -> None:
    torch.manual_seed(0)
    plain = plain_mlp(64, 2)
    torch.manual_seed(0)
    slow = mlp(64, 2, factor=3.0)
    assert list(slow.state_dict()) == list(plain.state_dict())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(3):
        for a, b in zip(_grads(plain, x, y), _grads(slow, x, y), strict=True):
            assert torch.equal(a, b)
    assert slow.compute_s > 0
    # 3 forwards padded by 2x their time, the 2nd and 3rd backwards by 2x the previous one's: the
    # padding asked for is 2x all compute measured but the last backward's.
    assert slow.padded_s == pytest.approx(2 * (slow.compute_s - slow._last_bwd), rel=1e-9)
    assert slow.padded_s > 0


def test_eval_and_no_grad_are_not_padded() -> None:
    slow = mlp(32, 1, factor=4.0)
    with torch.no_grad():
        slow(torch.randn(8, 64))
    slow.eval()
    slow(torch.randn(8, 64))
    assert slow.padded_s == 0 and slow.compute_s == 0


def test_factor_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert slowdown() == 1.0 and mlp(8, 1).factor == 1.0
    monkeypatch.setenv(ENV, "4")
    assert mlp(8, 1).factor == 4.0
