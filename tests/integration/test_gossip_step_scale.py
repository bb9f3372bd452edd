"""Plain gossip's step scale: with the shares in flight while a node steps, the push-sum average moves a whole step."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from gossamer.gossip.pushsum import PushSumPeer, step_scale

DIM = 100
STEP = torch.tensor([1.0, 3.0]).repeat_interleave(DIM // 2)  # node 0 steps by -1, node 1 by -3 per round


@pytest.fixture
def peers() -> Iterator[list[PushSumPeer]]:
    ps = [PushSumPeer(experiment="scale", peer_id=str(i), numel=DIM) for i in range(2)]
    for p in ps:
        p.set_membership({q.peer_id: q.endpoint for q in ps if q is not p}, 1)
    yield ps
    for p in ps:
        p.close()


def average_after(peers: list[PushSumPeer], rounds: int, scaled: bool) -> torch.Tensor:
    """Rounds as in the overlapped trainer: send, then step while the other's share is in flight, then mix it."""
    zs = [torch.zeros(DIM) for _ in peers]
    for r in range(rounds):
        for i, p in enumerate(peers):
            p.send(zs[i], peers[1 - i].peer_id, step=r)
        for i, p in enumerate(peers):
            zs[i] -= STEP.roll(i * DIM // 2) * (step_scale(p.weight) if scaled else 1.0)
        for p in peers:  # wait for the share of this round (driven by its arrival, bounded)
            deadline = time.monotonic() + 30
            while peers[1 - peers.index(p)].peer_id not in p.arrived_from(r, timeout=0.05):
                assert time.monotonic() < deadline, "share never arrived"
        for i, p in enumerate(peers):
            assert p.wait_settled(30)
            p.mix(zs[i])
    assert sum(p.weight for p in peers) == pytest.approx(2.0, abs=1e-12)  # mass conserved
    return sum(p.weight * z for p, z in zip(peers, zs, strict=True)) / 2  # type: ignore[return-value]


def test_scaled_steps_move_the_average_by_the_mean_step_and_unscaled_by_half(peers: list[PushSumPeer]) -> None:
    rounds = 10
    # Every node steps with weight 1/2 (it has just sent half, the other's half is in flight):
    # the mean of the two nodes' steps is -2 on every entry per round.
    avg = average_after(peers, rounds, scaled=True)
    assert float((avg + 2.0 * rounds).abs().max()) < 1e-4, avg[:4]
    for p in peers:  # a fresh start (same weights 1 both): the unscaled steps only move it half as far
        p.weight = 1.0
    avg = average_after(peers, rounds, scaled=False)
    assert float((avg + 1.0 * rounds).abs().max()) < 1e-4, avg[:4]


def test_the_scale_is_one_over_the_weight_and_bounded() -> None:
    assert step_scale(0.5) == 2.0 and step_scale(1.0) == 1.0 and step_scale(4.0) == 0.25
    assert step_scale(2.0**-10) == 2.0  # a drained node does not take 1024x steps
