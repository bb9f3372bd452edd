"""Gossip communication graphs: which one peer a rank pushes to at a given round."""

from __future__ import annotations

import hashlib
import random

from gossamer.core.modes import TOPOLOGIES

__all__ = ["TOPOLOGIES", "out_peer", "revisit_rounds"]

#: The graph names accepted by `out_peer` (the experiment's `topology` field).


def _stable_seed(*parts: int) -> int:
    """A seed that is the same in every process (Python's own hash of a tuple is salted)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def out_peer(topology: str, rank: int, n: int, round: int, seed: int = 0) -> int | None:
    """The rank that `rank` sends its push-sum share to at `round`, among ranks 0..n-1.

    * ``exponential``: the time-varying directed exponential graph of SGP (Assran et al.
      2019, https://arxiv.org/abs/1811.10792): at round r the peer ``2**(r mod ceil(log2 n))``
      hops ahead. For n a power of two, log2 n consecutive rounds average exactly.
    * ``ring``: always the next rank.
    * ``random``: a uniformly random other rank, the same in every process for a given
      (seed, round, rank).

    Returns:
        The peer's rank, never `rank` itself; None when ``n == 1`` (nobody to talk to).

    Raises:
        ValueError: unknown `topology`, or `rank`/`n`/`round` out of range.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown gossip topology {topology!r}; expected one of {TOPOLOGIES}")
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in 0..{n - 1}")
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    if n == 1:
        return None
    if topology == "ring":
        return (rank + 1) % n
    if topology == "exponential":
        k = (n - 1).bit_length()  # ceil(log2 n): hops 1, 2, ..., 2**(k-1) < n, never n
        return (rank + (1 << (round % k))) % n
    pick = random.Random(_stable_seed(seed, round, rank)).randrange(n - 1)
    return pick if pick < rank else pick + 1


def revisit_rounds(topology: str, n: int) -> int | None:
    """Every in-neighbour of a rank pushes to it again within this many rounds (n ranks); None: no
    bound (``random``: a rank may go any number of rounds without hearing from a given peer).

    ``exponential``: the peer 2**i hops behind pushes once every ceil(log2 n) rounds; ``ring``: every round.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown gossip topology {topology!r}; expected one of {TOPOLOGIES}")
    if topology == "random":
        return None
    return max(1, (n - 1).bit_length()) if topology == "exponential" else 1
