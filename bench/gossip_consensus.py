"""Consensus distance that compressed push-sum reaches with and without CHOCO differences (4 peers, loopback).

    python -m bench.gossip_consensus [--rounds 60] [--dim 100000] [--runs 3]

Writes bench/results/gossip_consensus.{json,md}. Pure averaging (no training between rounds):
what is left is the codec's doing. relative = sqrt(mean over peers of mean((z_i - avg)^2)) /
rms(avg) (qsgd:127 as values stops at 6.2e-2, as differences it reaches 0).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from bench._report import write_report
from gossamer.training.gossip import PushSumPeer, out_peer

CASES = (("none", False), ("int8", False), ("int8", True), ("qsgd:127", False), ("qsgd:127", True),
         ("fp16", False), ("fp16", True))


def relative_distance(peers: list[PushSumPeer], zs: list[torch.Tensor]) -> float:
    num = sum(p.weight * z.double() for p, z in zip(peers, zs, strict=True))
    avg = num / sum(p.weight for p in peers)  # type: ignore[operator]
    dist = sum(float(((z.double() - avg) ** 2).mean()) for z in zs) / len(zs)
    return math.sqrt(dist / float((avg**2).mean()))


def run(codec: str, differences: bool, rounds: int, dim: int, seed: int) -> dict[str, Any]:
    peers = [PushSumPeer(experiment="bench", peer_id=f"p{i}", codec=codec, ack_timeout_s=5.0,
                         differences=differences, numel=dim) for i in range(4)]
    try:
        for p in peers:
            p.set_membership({q.peer_id: q.endpoint for q in peers if q is not p}, 1)
        g = torch.Generator().manual_seed(seed)
        zs = [torch.randn(dim, generator=g) + 0.3 * i for i in range(4)]
        trace = []
        for r in range(rounds):
            for p, z in zip(peers, zs, strict=True):
                p.mix(z)
            for i, (p, z) in enumerate(zip(peers, zs, strict=True)):
                j = out_peer("exponential", i, 4, r)
                assert j is not None
                p.send(z, peers[j].peer_id, step=r)
            for p in peers:
                if not p.wait_settled(30.0):
                    raise RuntimeError(f"{p.peer_id} did not settle")
            for p, z in zip(peers, zs, strict=True):
                p.mix(z)
            trace.append(relative_distance(peers, zs))
        up = sum(p.bytes_up for p in peers)
        raw = sum(p.raw_bytes_up for p in peers)
        return {"final": trace[-1], "at_20": trace[min(19, rounds - 1)], "ratio": raw / up}
    finally:
        for p in peers:
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for codec, diff in CASES:
        res = [run(codec, diff, args.rounds, args.dim, seed) for seed in range(args.runs)]
        finals = [r["final"] for r in res]
        rows.append({
            "codec": codec,
            "sent_as": "differences (CHOCO)" if diff else "values",
            # As text: the table's fixed three decimals would print 1e-14 as 0.000.
            "relative_distance_median": f"{statistics.median(finals):.2e}",
            "min": f"{min(finals):.2e}",
            "max": f"{max(finals):.2e}",
            "at_round_20": f"{statistics.median(r['at_20'] for r in res):.2e}",
            "compression": statistics.median(r["ratio"] for r in res),
        })
        print(rows[-1], flush=True)
    notes = (f"4 push-sum peers on loopback, exponential graph, {args.dim:,} values, "
             f"{args.rounds} rounds of pure averaging, {args.runs} seeds; relative distance after the "
             "last round (median, min, max) and after round 20.")
    _, md = write_report("gossip_consensus", rows, notes, args.out_dir)
    print(md.read_text())


if __name__ == "__main__":
    main()
