"""bf16 autocast and global-norm clipping on the async parameter-server path (real shards, one worker)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests._fixtures import experiment
from tests.integration._ps_harness import run_async

pytestmark = pytest.mark.timeout(600)


#: The digits experiment of these tests (overrides per test).
ASYNC: dict[str, Any] = dict(name="p", mode="async", lr=0.05, momentum=0.9, num_ps_shards=2, total_steps=800,
                             eval_every=0)


def test_bf16_autocast_trains_as_well_as_fp32() -> None:
    fp32 = run_async(experiment(ASYNC), workers=1)
    bf16 = run_async(experiment(ASYNC, precision="bf16"), workers=1)
    print(f"fp32 {fp32['accuracy']:.4f} ({fp32['loss']:.5f}) bf16 {bf16['accuracy']:.4f} ({bf16['loss']:.5f})")
    assert bf16["loss"] != fp32["loss"]  # autocast really ran the forward in bf16
    assert bf16["accuracy"] >= fp32["accuracy"] - 0.02
    assert bf16["accuracy"] >= 0.93


def test_clipping_bounds_every_pushed_gradient() -> None:
    got = run_async(experiment(ASYNC, max_grad_norm=0.5, total_steps=300), workers=1)
    trainer = got["trainers"][0]  # type: ignore[index]
    assert math.isfinite(trainer.grad_norm) and trainer.grad_norm > 0  # measured before clipping
    # The shard applied sgd on clipped gradients: at most lr * max_norm / (1 - momentum) per step.
    assert got["accuracy"] >= 0.85
    clipped = run_async(experiment(ASYNC, max_grad_norm=1e-4, total_steps=300), workers=1)
    assert clipped["accuracy"] < got["accuracy"] - 0.2  # a tiny bound really holds the steps back
