"""Gossip graphs: one peer per round, never itself, and exponential rounds that mix everyone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gossamer.training.gossip import TOPOLOGIES, out_peer
from gossamer.training.gossip.topology import revisit_rounds

SIZES = [2, 3, 4, 5, 7, 8, 16, 33]


Matrix = list[list[float]]


def mixing_matrix(topology: str, n: int, round: int, seed: int = 0) -> Matrix:
    """Column-stochastic push-sum matrix of one round: keep half, push half to the peer."""
    m = [[0.0] * n for _ in range(n)]
    for i in range(n):
        j = out_peer(topology, i, n, round, seed)
        assert j is not None
        m[i][i] += 0.5
        m[j][i] += 0.5
    return m


def matmul(a: Matrix, b: Matrix) -> Matrix:
    n = len(a)
    return [[sum(a[i][k] * b[k][j] for k in range(n)) for j in range(n)] for i in range(n)]


def identity(n: int) -> Matrix:
    return [[float(i == j) for j in range(n)] for i in range(n)]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("n", SIZES)
def test_out_peer_is_another_valid_rank(topology: str, n: int) -> None:
    for r in range(40):
        for rank in range(n):
            peer = out_peer(topology, rank, n, r, seed=3)
            assert peer is not None and 0 <= peer < n and peer != rank


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_single_rank_has_no_peer(topology: str) -> None:
    assert out_peer(topology, 0, 1, 5) is None


@pytest.mark.parametrize("n", SIZES)
def test_exponential_covers_every_power_of_two_distance_over_log2_n_rounds(n: int) -> None:
    k = (n - 1).bit_length()
    for rank in range(n):
        hops = {(out_peer("exponential", rank, n, r) - rank) % n for r in range(k)}  # type: ignore[operator]
        assert hops == {2**i for i in range(k)}
        # and the schedule repeats with period ceil(log2 n)
        assert out_peer("exponential", rank, n, k + 1) == out_peer("exponential", rank, n, 1)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_exponential_mixes_every_rank_into_every_other_in_log2_n_rounds(n: int) -> None:
    k = n.bit_length() - 1
    for start in range(k):  # from any round, not just round 0
        product = identity(n)
        for r in range(start, start + k):
            product = matmul(mixing_matrix("exponential", n, r), product)
        assert all(x > 0 for row in product for x in row)
        # Power-of-two exponential graphs even average exactly: every entry is 1/n.
        assert all(x == pytest.approx(1.0 / n, abs=1e-12) for row in product for x in row)


@pytest.mark.parametrize("n", [3, 5, 7])
def test_exponential_mixes_everyone_eventually_for_other_sizes(n: int) -> None:
    product = identity(n)
    for r in range(4 * n):
        product = matmul(mixing_matrix("exponential", n, r), product)
    assert all(x > 0 for row in product for x in row)


def test_ring_is_the_next_rank() -> None:
    assert [out_peer("ring", r, 5, 7) for r in range(5)] == [1, 2, 3, 4, 0]


def test_random_is_deterministic_and_depends_on_seed_and_round() -> None:
    n = 16
    a = [[out_peer("random", i, n, r, seed=1) for i in range(n)] for r in range(20)]
    b = [[out_peer("random", i, n, r, seed=1) for i in range(n)] for r in range(20)]
    c = [[out_peer("random", i, n, r, seed=2) for i in range(n)] for r in range(20)]
    assert a == b
    assert a != c
    assert len({tuple(row) for row in a}) > 1
    # every other rank gets picked by somebody over the rounds
    assert {p for row in a for p in row} == set(range(n))


def test_random_is_the_same_in_another_process() -> None:
    import gossamer.training.gossip.topology as topology

    # Load the module alone under different hash salts.
    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('t', sys.argv[1]); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); "
        "print([m.out_peer('random', i, 9, 4, 7) for i in range(9)])"
    )
    here = str([out_peer("random", i, 9, 4, 7) for i in range(9)])
    for hashseed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code, str(topology.__file__)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": hashseed, "PATH": ""},
        )
        assert out.stdout.strip() == here


def test_importing_the_topologies_does_not_import_torch() -> None:
    code = "import sys, gossamer.training.gossip; gossamer.training.gossip.out_peer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_topology_and_bad_ranks_raise() -> None:
    with pytest.raises(ValueError, match="unknown gossip topology 'torus'"):
        out_peer("torus", 0, 4, 0)
    with pytest.raises(ValueError):
        out_peer("ring", 4, 4, 0)
    with pytest.raises(ValueError):
        out_peer("ring", 0, 4, -1)


@pytest.mark.parametrize("topology", ["exponential", "ring"])
@pytest.mark.parametrize("n", SIZES)
def test_every_in_neighbour_comes_back_within_revisit_rounds(topology: str, n: int) -> None:
    # LagBound reads a neighbour's progress from its latest share: it must come again this often.
    rounds = revisit_rounds(topology, n)
    assert rounds is not None and rounds >= 1
    span = 4 * rounds
    for me in range(n):
        senders = {i for r in range(span) for i in range(n) if out_peer(topology, i, n, r) == me}
        assert senders
        for start in range(span - rounds + 1):
            window = {i for r in range(start, start + rounds) for i in range(n) if out_peer(topology, i, n, r) == me}
            assert window == senders, (me, start, window, senders)
    assert revisit_rounds("random", n) is None
