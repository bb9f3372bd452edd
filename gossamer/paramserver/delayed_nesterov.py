"""Delayed Nesterov: the outer optimizer of asynchronous DiLoCo (momentum once per round of arrivals)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DelayedNesterov"]


class DelayedNesterov(torch.optim.Optimizer):
    """Nesterov SGD whose momentum moves once every `delay` updates (N), not on each.

    Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling",
    https://arxiv.org/abs/2401.09135 (Delayed Nesterov, "DN"): asynchronous arrivals of stale
    pseudo-gradients each pushing the momentum carry the model past the optimum (digits, 4
    workers: 0.63 with Nesterov per arrival, 0.975 without). DN buffers the updates and, on
    every arrival ``g``, takes a plain step ``p -= lr * g``; on every N-th it also updates the
    momentum with the buffer and takes the momentum part of a Nesterov step::

        m = momentum * m + sum(buffer) * N / arrivals;  p -= lr * momentum * m;  buffer = 0

    An arrival is a worker's share of a round: its pseudo-gradient already divided by the
    number of workers (`DilocoTrainer`, so that sync DiLoCo's shards sum them to the mean).
    Over the N arrivals of a round ``p`` then moves by ``-lr * (mean + momentum * m)``, exactly
    one Nesterov step on the mean of the N pseudo-gradients: sync DiLoCo's outer step. (An
    earlier version divided each share by N once more, so the async outer step was a third of
    the sync one at 3 workers; bench/results/modes.md.) The paper's N, used here: the number of
    workers (the shard sets it from the workers it serves, `set_delay`).

    State per parameter: ``momentum_buffer``, ``delay_buffer`` (tensors) and ``arrivals`` (an
    int: updates in the buffer), all exported with the shard's checkpoints.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, momentum: float, delay: int = 1) -> None:
        if not lr > 0 or not 0 <= momentum < 1 or delay < 1:
            raise ValueError(f"bad DelayedNesterov settings lr={lr} momentum={momentum} delay={delay}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay})

    def set_delay(self, delay: int) -> None:
        """N from now on (the number of workers); a buffer holding N or more is folded at the next step."""
        for group in self.param_groups:
            group["delay"] = max(1, int(delay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, beta, n = group["lr"], group["momentum"], group["delay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if "delay_buffer" not in st:
                    st["delay_buffer"] = torch.zeros_like(p)
                    st["momentum_buffer"] = torch.zeros_like(p)
                    st["arrivals"] = 0
                buf, m = st["delay_buffer"], st["momentum_buffer"]
                buf.add_(g)
                arrivals = int(st["arrivals"]) + 1
                p.add_(g, alpha=-lr)
                if arrivals >= n:
                    m.mul_(beta).add_(buf, alpha=n / arrivals)
                    p.add_(m, alpha=-lr * beta)
                    buf.zero_()
                    arrivals = 0
                st["arrivals"] = arrivals
        return loss
