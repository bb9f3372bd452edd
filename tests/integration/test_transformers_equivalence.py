"""Sync with a tied-embedding GPT-2 (transformers, loss='model') equals one process on the global batch.

The shards hold `transformer.wte.weight` once (it is also `lm_head.weight`) and its gradient
is the sum over both uses, exactly as one plain PyTorch process computes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gossamer.core.experiment import Experiment
from gossamer.engine.model import build
from gossamer.engine.shard_plan import flatten_params
from tests.integration.test_user_loss_equivalence import _assert_equal, _reference, _train

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 4, "seq_len": 32}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_sync_tied_gpt2_on_two_workers_equals_single_process(tmp_path: Path) -> None:
    exp = Experiment(name="gpt2", model="gossamer.examples.gpt2:model", dataset="gossamer.examples.gpt2:data",
                     model_args=TINY, dataset_args={"seq_len": 32, "max_bytes": 50_000}, loss="model",
                     mode="sync", optimizer="sgd", lr=0.5, momentum=0.9, num_ps_shards=2, batch_size=8,
                     total_steps=10, eval_every=0)
    model, _, _ = build(exp, torch.device("cpu"))
    tied = model.lm_head.weight is model.transformer.wte.weight
    assert tied and "lm_head.weight" not in dict(model.named_parameters())
    start = flatten_params(model)
    got = _train(exp, 2, tmp_path)
    want = _reference(exp, 16, lambda out, b: out.loss, forward=lambda m, b: m(**b))
    assert got.numel() == start.numel() == sum(p.numel() for p in model.parameters())
    assert (want - start).abs().max().item() > 1e-2  # it trained: equality below is not of the initial values
    _assert_equal(got, want)
