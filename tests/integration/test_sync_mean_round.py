"""A train function's sync round on a real shard server (`ShardConfig.reduce`): each worker is answered with the
mean of the round's gradients, summed in sender order, and the shard holds the values the pushes carry."""

from __future__ import annotations

import threading

import pytest
import torch

from gossamer.core.errors import ShardError
from gossamer.paramserver import (
    OptimizerConfig,
    PullResult,
    ShardClient,
    ShardConfig,
    ShardPlan,
    ShardServer,
)
from gossamer.paramserver.push_parts import SYNC_PUSH_PART_BYTES

EXP = "mean"
#: The optimizer steps the workers had taken when they pushed.
STEPS = 7


def _server(plan: ShardPlan) -> tuple[ShardServer, str]:
    config = ShardConfig(experiment=EXP, shard=0, mode="sync", staleness=None, reduce=True, total_steps=1 << 62,
                         optimizer=OptimizerConfig(name="sgd", lr=1.0))
    server = ShardServer(config, plan, {c.index: torch.zeros(c.numel) for c in plan.chunks})
    endpoint = server.bind()
    server.start()
    return server, endpoint


def _round(plan: ShardPlan, endpoint: str, pushes: list[tuple[torch.Tensor, torch.Tensor]],
           order: list[int], *, clients: list[ShardClient] | None = None, step: int = 0,
           idle: tuple[int, ...] = ()) -> tuple[dict[int, PullResult], list[ShardClient]]:
    """Worker i pushes (gradient, values) of `pushes[i]` (their flat vectors) as one round, threads started in
    `order`, those in `idle` done; each worker's reply."""
    clients = clients or [ShardClient(experiment=EXP, sender=f"w{i}", plan=plan, endpoints={0: endpoint},
                                      timeout_s=60) for i in range(len(pushes))]
    results: dict[int, PullResult] = {}

    def push(i: int) -> None:
        results[i] = _push(clients[i], plan, *pushes[i], step=step, num_workers=len(pushes), idle=i in idle)

    threads = [threading.Thread(target=push, args=(i,)) for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == list(range(len(pushes)))
    return results, clients


def _push(client: ShardClient, plan: ShardPlan, grad: torch.Tensor, values: torch.Tensor, *, step: int,
          num_workers: int, idle: bool = False) -> PullResult:
    """A worker's exchange: each chunk's gradient then its values, under the barrier of `step`."""
    chunks = {c.index: torch.cat([grad[c.flat_offset:c.flat_offset + c.numel],
                                  values[c.flat_offset:c.flat_offset + c.numel]]) for c in plan.chunks}
    return client.push_pull(chunks, clock=STEPS, basis={0: step}, step=step, num_workers=num_workers, values=False,
                            idle=idle)


def _flat(plan: ShardPlan, values: dict[int, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(plan.total_numel)
    plan.scatter(out, values)
    return out


def test_every_worker_gets_the_rounds_mean_summed_in_sender_order_and_the_shard_holds_the_pushed_values() -> None:
    """Three workers' gradients 1, 2^-24, 2^-24: in sender order (1 + 2^-24) + 2^-24 rounds to 1 twice, where
    2^-24 + 2^-24 + 1 is 1 + 2^-23; whatever order they come in, every worker gets the sender order's bits."""
    plan = ShardPlan.build([("w", 64)], 1, chunk_numel=16)
    server, endpoint = _server(plan)
    tiny = 2.0**-24
    values = torch.linspace(-1, 1, 64)
    pushes = [(torch.full((64,), g), values.clone()) for g in (1.0, tiny, tiny)]
    clients: list[ShardClient] = []
    try:
        results, clients = _round(plan, endpoint, pushes, order=[2, 1, 0])
        want = ((torch.full((64,), 1.0) + tiny) + tiny) / 3
        assert not torch.equal(want, ((torch.full((64,), tiny) + tiny) + 1.0) / 3)
        for res in results.values():
            assert torch.equal(_flat(plan, res.values), want) and res.versions == {0: 1}
        assert server.version == 1
        # A worker that joins now starts from the run's parameters and counts on from the steps they are of.
        assert torch.equal(_flat(plan, clients[0].pull().values), values) and clients[0].steps == {0: STEPS}
        # The round's push sent again (its reply lost) is answered with that round's mean; an older round's is gone.
        again = _push(clients[1], plan, *pushes[1], step=0, num_workers=3)
        assert torch.equal(_flat(plan, again.values), want) and server.version == 1
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_large_round_goes_in_parts_and_each_worker_gets_the_whole_mean_in_the_last_reply() -> None:
    """Two workers' 48 MiB pushes (gradient and values of 6M parameters) go in parts under 16 MiB; the last
    part's answer holds the mean of every chunk (no pull after it, which would read the parameters)."""
    plan = ShardPlan.build([("w", 6 << 20)], 1, chunk_numel=1 << 20)
    server, endpoint = _server(plan)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(plan.total_numel, generator=g)
    pushes = [(torch.randn(plan.total_numel, generator=g), values) for _ in range(2)]
    clients: list[ShardClient] = []
    try:
        results, clients = _round(plan, endpoint, pushes, order=[0, 1])
        # A chunk's gradient and values are 8 MiB: two do not fit under the part budget, so a part each, and no PULL.
        assert 2 * 8 * plan.chunks[0].numel >= SYNC_PUSH_PART_BYTES
        assert [c.messages for c in clients] == [len(plan.chunks)] * 2
        want = (pushes[0][0] + pushes[1][0]) / 2
        for res in results.values():
            assert torch.equal(_flat(plan, res.values), want)
        assert torch.equal(_flat(plan, clients[0].pull().values), values)
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_done_workers_idle_push_holds_its_place_and_idle_pushes_alone_make_no_version() -> None:
    """A worker that joined may be a step behind the others: they push idle for it, and its mean is its own
    gradient; once it is done too, a round of idle pushes alone leaves the version as it was (all are done)."""
    plan = ShardPlan.build([("w", 64)], 1, chunk_numel=16)
    server, endpoint = _server(plan)
    g = torch.Generator().manual_seed(0)
    pushes = [(torch.randn(64, generator=g), torch.randn(64, generator=g)) for _ in range(2)]
    clients: list[ShardClient] = []
    try:
        results, clients = _round(plan, endpoint, pushes, order=[0, 1], idle=(0,))
        for res in results.values():
            assert torch.equal(_flat(plan, res.values), pushes[1][0]) and res.versions == {0: 1}
        assert torch.equal(_flat(plan, clients[0].pull().values), pushes[1][1])  # the stepping worker's values
        results, _ = _round(plan, endpoint, pushes, order=[1, 0], clients=clients, step=1, idle=(0, 1))
        assert all(res.versions == {0: 1} and not res.values for res in results.values())
        assert server.version == 1
    finally:
        for c in clients:
            c.close()
        server.close()


def test_an_overflowed_gradient_makes_the_rounds_mean_not_finite_for_every_worker_and_values_must_be_finite() -> None:
    """One worker's fp16 step overflowed: its gradient goes into the mean, inf on every worker (each one's
    GradScaler skips the step), and the shard still holds finite values. Non-finite values are refused."""
    plan = ShardPlan.build([("w", 64)], 1, chunk_numel=16)
    server, endpoint = _server(plan)
    values = torch.linspace(-1, 1, 64)
    overflowed = torch.ones(64)
    overflowed[3] = float("inf")
    clients: list[ShardClient] = []
    try:
        results, clients = _round(plan, endpoint, [(torch.ones(64), values.clone()), (overflowed, values.clone())],
                                  order=[0, 1])
        for res in results.values():
            mean = _flat(plan, res.values)
            assert not bool(torch.isfinite(mean).all()) and mean[3] == float("inf"), mean
        pulled = clients[0].pull()
        assert torch.equal(_flat(plan, pulled.values), values) and pulled.versions == {0: 1}
        bad = values.clone()
        bad[5] = float("nan")
        with pytest.raises(ShardError, match="parameters pushed are not finite"):
            _push(clients[0], plan, torch.ones(64), bad, step=1, num_workers=1)
        assert server.discarded["nonfinite"] == 1
    finally:
        for c in clients:
            c.close()
        server.close()
