"""A user's model whose forward raises after a few steps on the node started with GOSSAMER_TEST_FAIL=1 (the digits MLP elsewhere)."""

from __future__ import annotations

import os

import torch
from torch import nn

from gossamer.examples.digits import mlp

#: What the user's error says: `gossamer logs` must show it, and the frame it was raised in.
MARKER = "the user's model refuses batch"


def _check_batch(calls: int) -> None:
    raise RuntimeError(f"{MARKER} {calls}: widths do not match")


class FlakyMLP(nn.Module):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.inner = mlp()
        self.after = after
        self.calls = 0
        self.fails = os.environ.get("GOSSAMER_TEST_FAIL") == "1"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fails and self.calls > self.after:
            _check_batch(self.calls)
        return self.inner(x)  # type: ignore[no-any-return]


def model(after: int = 20) -> nn.Module:
    return FlakyMLP(after)
