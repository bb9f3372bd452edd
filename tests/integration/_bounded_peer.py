"""A gossip peer of a 1M-parameter model in its own process for the memory-bound test: it answers snapshot requests."""

from __future__ import annotations

import time
from pathlib import Path

import torch

NUMEL = 1 << 20  # 4 MiB of fp32 values: one snapshot copy is plainly visible in the process's RSS
EXPERIMENT = "peer-bounds"


def serve(endpoint_file: str) -> None:
    """Run peer "0" and answer snapshot requests as a trainer does between its steps, until killed."""
    torch.set_num_threads(1)
    from gossamer.training.gossip import PushSumPeer

    peer = PushSumPeer(experiment=EXPERIMENT, peer_id="0", numel=NUMEL)
    z = torch.zeros(NUMEL)
    tmp = Path(endpoint_file + ".tmp")
    tmp.write_text(peer.endpoint)
    tmp.rename(endpoint_file)
    step = 0
    while True:
        step += 1
        z.add_(1.0)  # the trainer moves on: each serve() sends a new copy
        peer.serve(z, step)
        time.sleep(0.005)
