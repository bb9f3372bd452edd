"""Momentum on the worker before compression: EF-SignSGD with momentum, and DGC's correction, masking and warm-up."""

from __future__ import annotations

import torch

__all__ = ["WorkerMomentum", "warmup_density"]

#: DGC's first warm-up density and its number of stages (25%, then down to the ratio).
WARMUP_START = 0.25
WARMUP_STAGES = 4


class WorkerMomentum:
    """Per-key momentum buffers a worker applies to its gradient before compressing it.

    Momentum correction (Lin et al. 2018, "Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training", ICLR, https://arxiv.org/abs/1712.01887,
    section 3.2): each step ``u = m * u + g`` and the worker sends ``C(u + e)`` with error
    feedback's residual ``e``; the shards apply plain SGD (``w -= lr * sent``), so over the
    steps an entry receives what momentum SGD would have given it, only later. With Nesterov
    the sent quantity is ``g + m * u`` (torch's convention). Without compression this is
    momentum SGD exactly: sum over workers of each worker's ``u`` is the momentum of the summed
    gradient.

    Momentum factor masking (the same section): where an entry was sent, its momentum is
    reset, ``u[sent] = 0``, so a stale velocity does not push an entry again after its
    accumulated value went out (`mask`). Sparse codecs (top-k, random-k) use it; sign sends
    every entry and does not: it is then EF-SGD with momentum (Zheng, Huang and Kwok 2019,
    "Communication-Efficient Distributed Blockwise Momentum SGD with Error-Feedback",
    https://arxiv.org/abs/1905.10936), the error-feedback form of Signum (Bernstein et al.
    2018).

    Buffers are fp32 on the CPU, keyed like `ErrorFeedback` (one per chunk).
    """

    def __init__(self, momentum: float, *, nesterov: bool = False) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self._velocity: dict[str, torch.Tensor] = {}

    def step(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """Fold `grad` into `key`'s velocity; a new fp32 tensor: what to compress this step."""
        g = grad.detach().to(torch.float32)
        u = self._velocity.get(key)
        if u is None or u.shape != g.shape:
            u = g.clone()
        else:
            u.mul_(self.momentum).add_(g)
        self._velocity[key] = u
        return g + self.momentum * u if self.nesterov else u.clone()

    def mask(self, key: str, sent: torch.Tensor) -> None:
        """Momentum factor masking: zero `key`'s velocity where `sent` (bool, same size) is set."""
        u = self._velocity.get(key)
        if u is not None:
            u.masked_fill_(sent.reshape(u.shape), 0.0)

    def velocity(self, key: str) -> torch.Tensor | None:
        """The velocity of `key` (not a copy), or None."""
        return self._velocity.get(key)

    def reset(self) -> None:
        self._velocity.clear()


def warmup_density(ratio: float, step: int, warmup_steps: int) -> float:
    """DGC's density warm-up: the ratio a sparse codec uses at 0-based `step`.

    The warm-up falls exponentially in `WARMUP_STAGES` equal stages from `WARMUP_START`
    toward `ratio` (for a ratio of 0.001: 25%, 6.3%, 1.6%, 0.4%, then 0.1%, DGC's own
    schedule), and is `ratio` from `warmup_steps` on; never below `ratio`.
    """
    if step >= warmup_steps or ratio >= WARMUP_START:
        return ratio
    stage = min(WARMUP_STAGES - 1, step * WARMUP_STAGES // warmup_steps)
    # Three significant digits: the density is written into the codec spec the push names.
    return max(ratio, float(f"{WARMUP_START * (ratio / WARMUP_START) ** (stage / WARMUP_STAGES):.3g}"))
