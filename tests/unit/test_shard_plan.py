"""Shard plan: every element covered once, greedy balance, determinism, JSON round trip."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossamer.core.errors import ConfigError
from gossamer.engine.shard_plan import ShardPlan, flatten_params, unflatten_into

named = st.lists(st.integers(0, 50), min_size=1, max_size=12).map(
    lambda ns: [(f"p{i}", n) for i, n in enumerate(ns)]
)


@settings(max_examples=100, deadline=None)
@given(named=named, shards=st.integers(1, 5), chunk=st.integers(1, 17))
def test_chunks_cover_every_element_exactly_once(named, shards, chunk):
    plan = ShardPlan.build(named, shards, chunk)
    seen = torch.zeros(plan.total_numel, dtype=torch.int64)
    for c in plan.chunks:
        assert 0 < c.numel <= chunk
        seen[c.flat_offset : c.flat_offset + c.numel] += 1
    assert bool((seen == 1).all())
    assert sorted(
        i for s in range(shards) for i in (c.index for c in plan.chunks_of_shard(s))
    ) == list(range(len(plan.chunks)))
    world = 3
    ranks = [c.index for r in range(world) for c in plan.chunks_of_rank(r, world)]
    assert sorted(ranks) == list(range(len(plan.chunks)))


def test_greedy_placement_balances_shards_within_one_chunk():
    plan = ShardPlan.build([("w", 10_000), ("b", 300), ("v", 7_777)], 4, chunk_numel=1000)
    loads = [plan.shard_numel(s) for s in range(4)]
    assert max(loads) - min(loads) <= 1000


def test_rank_split_balances_local_ranks():
    plan = ShardPlan.build([("w", 10_000), ("b", 300)], 2, chunk_numel=1000)
    loads = [sum(c.numel for c in plan.chunks_of_rank(r, 3)) for r in range(3)]
    assert max(loads) - min(loads) <= 1000


def test_build_is_deterministic_and_fingerprint_stable():
    a = ShardPlan.build([("w", 5000), ("b", 10)], 3, 512)
    b = ShardPlan.build([("w", 5000), ("b", 10)], 3, 512)
    assert a == b and a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != ShardPlan.build([("w", 5000), ("b", 10)], 2, 512).fingerprint()


def test_to_dict_round_trips_through_json():
    plan = ShardPlan.build([("w", 5000), ("b", 10)], 3, 512)
    back = ShardPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and back.fingerprint() == plan.fingerprint()


def test_from_dict_rejects_a_plan_that_misses_elements():
    d = ShardPlan.build([("w", 100)], 2, 30).to_dict()
    d["chunks"].pop()
    with pytest.raises(ConfigError):
        ShardPlan.from_dict(d)


@pytest.mark.parametrize("shards, chunk", [(0, 10), (2, 0)])
def test_build_rejects_bad_sizes(shards, chunk):
    with pytest.raises(ConfigError):
        ShardPlan.build([("w", 10)], shards, chunk)


def test_flatten_and_unflatten_follow_named_parameters_order():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    flat = flatten_params(m)
    plan = ShardPlan.for_module(m, 2, chunk_numel=5)
    assert plan.total_numel == flat.numel() == 26
    values = plan.gather(flat)
    other = torch.zeros_like(flat)
    plan.scatter(other, values)
    m2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    unflatten_into(m2, other)
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)
