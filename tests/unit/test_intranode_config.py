"""Intra-node settings: the plan cut for FSDP and pipeline, stage splits, precision, clipping, lr scaling."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gossamer.core.errors import ConfigError
from gossamer.engine.layout import FSDP_MAX_LOCAL_RANKS, fsdp_row_cuts, pipeline_split
from gossamer.engine.precision import LossScaler, check_precision
from gossamer.examples.digits import mlp
from gossamer.paramserver import ShardPlan
from tests._fixtures import experiment

#: The digits experiment of these tests (overrides per test).
NAMED: dict[str, Any] = dict(name="x")


def _fsdp_regions(shape: tuple[int, ...], world: int) -> list[tuple[int, int]]:
    """(start, end) element ranges of each rank's dim-0 shard, as FSDP2's torch.chunk cuts them."""
    rows, per_row = shape[0], int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1
    step = -(-rows // world)
    return [(r * step * per_row, min(rows, (r + 1) * step) * per_row) for r in range(world) if r * step < rows]


@pytest.mark.parametrize("world", range(1, FSDP_MAX_LOCAL_RANKS + 1))
def test_fsdp_plan_cuts_every_rank_shard_into_whole_chunks(world: int) -> None:
    model = mlp(hidden=100)  # 100 rows: uneven splits for 3, 6, 7, 8
    plan = ShardPlan.for_module(model, 2, chunk_numel=1000, align="fsdp")
    bounds = {c.flat_offset for c in plan.chunks} | {plan.total_numel}
    offset = 0
    for _, p in model.named_parameters():
        for lo, hi in _fsdp_regions(tuple(p.shape), world):
            assert offset + lo in bounds and offset + hi in bounds, (p.shape, world, lo, hi)
        offset += p.numel()
    assert all(c.numel <= 1000 for c in plan.chunks)
    assert {c.shard for c in plan.chunks} == {0, 1}
    assert ShardPlan.from_dict(plan.to_dict()) == plan  # tiles the model exactly once


def test_row_cuts_match_torch_chunk() -> None:
    for rows in (1, 2, 7, 10, 128):
        want = set()
        for world in range(2, 9):
            sizes = [c.shape[0] for c in torch.arange(rows).chunk(world)]
            want.update(sum(sizes[:i]) for i in range(1, len(sizes)))
        assert fsdp_row_cuts(rows) == want


def test_param_plan_never_spans_two_parameters_and_pack_does() -> None:
    model = mlp()
    names = {c.name for c in ShardPlan.for_module(model, 1, align="param").chunks}
    param = ShardPlan.for_module(model, 1, align="param")
    offsets = {c.flat_offset for c in param.chunks}
    start = 0
    for _, p in model.named_parameters():
        assert start in offsets
        start += p.numel()
    assert len(names) == 6
    assert len(ShardPlan.for_module(model, 1).chunks) == 1  # packed: one chunk for the small model
    with pytest.raises(ConfigError, match="align"):
        ShardPlan.for_module(model, 1, align="rows")


def test_plan_for_experiment_follows_parallelism() -> None:
    model = mlp()
    assert ShardPlan.for_experiment(model, experiment(NAMED)) == ShardPlan.for_module(model, 1)
    assert ShardPlan.for_experiment(model, experiment(NAMED, parallelism="fsdp")) == ShardPlan.for_module(model, 1, align="fsdp")
    assert ShardPlan.for_experiment(model, experiment(NAMED, parallelism="pipeline")) == \
        ShardPlan.for_module(model, 1, align="param")


def test_pipeline_split_balances_contiguous_stages() -> None:
    assert pipeline_split(mlp(), 2) == [[0, 1], [2, 3, 4]]
    assert pipeline_split(mlp(), 3) == [[0, 1], [2, 3], [4]]
    groups = pipeline_split(nn.Sequential(nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100),
                                          nn.Linear(100, 2)), 2)
    assert groups == [[0, 1, 2], [3, 4]]
    assert sorted(i for g in groups for i in g) == list(range(5))
    with pytest.raises(ConfigError, match="at least 4 layers"):
        pipeline_split(mlp(), 4)
    with pytest.raises(ConfigError, match="nn.Sequential"):
        pipeline_split(nn.Linear(2, 2), 2)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("parallelism", "fsdp", "runs with the parameter servers"),
    ("pipeline_schedule", "zb", "unknown schedule"),
    ("pipeline_microbatches", 0, ">= 1"),
    ("precision", "fp8", "unknown precision"),
    ("max_grad_norm", -1.0, ">= 0"),
    ("max_grad_norm", float("nan"), ">= 0"),
    ("lr_scaling", "sqrt", "unknown lr scaling"),
    ("base_batch_size", -1, ">= 0"),
])
def test_bad_intranode_settings_name_the_field(field: str, value: object, message: str) -> None:
    kw: dict[str, object] = {field: value}
    if field == "parallelism":
        kw["mode"] = "gossip"
    with pytest.raises(ConfigError, match=message) as e:
        experiment(NAMED, **kw)
    assert e.value.field == field


def test_pipeline_needs_microbatches_that_divide_the_batch() -> None:
    with pytest.raises(ConfigError, match="must divide batch_size"):
        experiment(NAMED, parallelism="pipeline", batch_size=30, pipeline_microbatches=4)
    assert experiment(NAMED, parallelism="pipeline", batch_size=32, pipeline_microbatches=8).pipeline_microbatches == 8


def test_linear_scaling_rule() -> None:
    assert experiment(NAMED, batch_size=64).linear_lr_factor() == 1.0  # off by default
    assert experiment(NAMED, batch_size=64, lr_scaling="linear", base_batch_size=32).linear_lr_factor() == 2.0
    sync = experiment(NAMED, mode="sync", batch_size=32, lr_scaling="linear", base_batch_size=32)
    assert sync.linear_lr_factor(4) == 4.0  # the global batch grows with the workers
    fixed = experiment(NAMED, mode="sync", global_batch_size=256, lr_scaling="linear", base_batch_size=128)
    assert fixed.linear_lr_factor(3) == fixed.linear_lr_factor(8) == 2.0


def test_fp16_is_refused_off_cuda_and_bf16_is_not() -> None:
    with pytest.raises(ConfigError, match="bf16"):
        check_precision(experiment(NAMED, precision="fp16"), torch.device("cpu"))
    check_precision(experiment(NAMED, precision="bf16"), torch.device("cpu"))


def test_loss_scaler_backs_off_on_overflow_and_grows_after_clean_steps() -> None:
    s = LossScaler(init_scale=1024.0, growth_interval=3)
    assert s.update(False) is False and s.scale == 512.0
    assert all(s.update(True) for _ in range(3)) and s.scale == 1024.0
    for _ in range(40):
        s.update(False)
    assert s.scale == 1.0  # never below 1
