"""A sync push of a large dense update in parts, one at a time per shard, so the shard holds the step's sum and a part."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from gossamer.paramserver.push_credits import CREDIT_MIN_BYTES
from gossamer.protocol import PushMeta, parse_chunk_key
from gossamer.transport.frames import Message

__all__ = ["SYNC_PUSH_PART_BYTES", "part_tensors", "push_rounds"]

#: A dense sync push to a shard larger than this goes in parts of whole chunks, each under it (so no part asks
#: for a credit). A shard adds each part into the step's sum as it comes and acknowledges it; the next part of
#: that connection goes then. Sent whole, a worker's push was read whole while the shard held the sum (the first
#: worker's push) already: 2x the shard beside its state, where parts cost the sum and a part or two.
SYNC_PUSH_PART_BYTES = CREDIT_MIN_BYTES

#: Makes a PUSH to `shard` with this meta and these tensors (a new request id, the sender's token).
MakePush = Callable[[int, dict[str, object], dict[str, torch.Tensor]], Message]


def part_tensors(tensors: Mapping[str, torch.Tensor], budget: int) -> list[dict[str, torch.Tensor]]:
    """`tensors` in their order, cut into groups of under `budget` bytes (a tensor that large goes alone)."""
    groups: list[dict[str, torch.Tensor]] = []
    size = budget
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size + nbytes >= budget:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return groups


def push_rounds(reqs: Mapping[int, Message], make: MakePush,
                budget: int = SYNC_PUSH_PART_BYTES) -> tuple[list[dict[int, Message]], dict[int, list[int]]]:
    """The rounds in which to send a sync push's messages (shard -> dense PUSH), and the chunks of each shard
    whose push went in parts.

    Every round but the last holds parts that say more follow (PUSH meta `part`, `more`): each is answered once
    in the step's sum, and the next round goes when the round is answered. The last round holds each shard's
    last part, or its whole message where that is under `budget`; it is answered at the step. Parts are answered
    with an ack (no values): the caller pulls the values of the parted shards' chunks after the last round.
    """
    parts: dict[int, list[Message]] = {}
    parted: dict[int, list[int]] = {}
    for s, msg in reqs.items():
        groups = part_tensors(msg.tensors, budget)
        if len(groups) < 2:
            parts[s] = [msg]
            continue
        meta = dataclasses.replace(PushMeta.from_meta(msg.meta, barrier=True), values=False)
        parts[s] = [make(s, dataclasses.replace(meta, part=k, more=k < len(groups) - 1).to_meta(), group)
                    for k, group in enumerate(groups)]
        parted[s] = sorted(parse_chunk_key(name) for name in msg.tensors)
    last = max(len(p) for p in parts.values())
    rounds = [{s: p[r] for s, p in parts.items() if r < len(p) - 1} for r in range(last - 1)]
    rounds.append({s: p[-1] for s, p in parts.items()})
    return rounds, parted
