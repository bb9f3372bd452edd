"""A large dense push in parts: a sync push one part at a time per shard (the shard holds the step's sum and a part),
an async push as fragments back to back (the shard steps and answers each while the rest still travels)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from gossamer.core.errors import ConfigError
from gossamer.core.protocol import PushMeta, parse_chunk_key
from gossamer.paramserver.push_credits import CREDIT_MIN_BYTES
from gossamer.transport.frames import Message

__all__ = ["FRAGMENT_BYTES", "SYNC_PUSH_PART_BYTES", "FragmentedPushes", "fragments", "most_fragments",
           "part_tensors", "push_rounds"]

#: A dense sync push to a shard larger than this goes in parts of whole chunks, each under it (so no part asks
#: for a credit). A shard adds each part into the step's sum as it comes and acknowledges it; the next part of
#: that connection goes then. Sent whole, a worker's push was read whole while the shard held the sum (the first
#: worker's push) already: 2x the shard beside its state, where parts cost the sum and a part or two.
SYNC_PUSH_PART_BYTES = CREDIT_MIN_BYTES

#: An async dense push to a shard of this size or more goes as fragments each under it. Sent whole, the
#: shard read all of it, then stepped all of it, then sent all of the values back: three passes in a row
#: over the shard (bench/scale_model.py push+pull). As fragments, the shard checks each on arrival and
#: answers each with its stepped values while the next fragment's answer is still being stepped.
FRAGMENT_BYTES = CREDIT_MIN_BYTES

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
    last = max((len(p) for p in parts.values()), default=1)  # no messages (a rank with no chunks): one empty round
    rounds = [{s: p[r] for s, p in parts.items() if r < len(p) - 1} for r in range(last - 1)]
    rounds.append({s: p[-1] for s, p in parts.items()})
    return rounds, parted


def fragments(msg: Message, budget: int = FRAGMENT_BYTES) -> list[Message]:
    """An async dense PUSH as fragments of whole chunks under `budget` bytes each, in order, all but the last
    saying more follow (PUSH meta `more`); `[msg]` where it is under `budget` or a single chunk.

    Every fragment keeps the push's request id: the shard answers each with its own chunks' values.
    """
    groups = part_tensors(msg.tensors, budget)
    if len(groups) < 2:
        return [msg]
    return [dataclasses.replace(msg, meta={**msg.meta, "more": True} if k < len(groups) - 1 else dict(msg.meta),
                                tensors=group)
            for k, group in enumerate(groups)]


def most_fragments(nbytes: int, budget: int = FRAGMENT_BYTES) -> int:
    """The most fragments a push of `nbytes` goes as: two fragments in a row hold `budget` bytes or more
    (the first ended because the next chunk did not fit)."""
    return 2 * -(-nbytes // budget) + 1


class FragmentedPushes:
    """A client's side of fragmented pushes: what to send for a request, and its answers put back together.

    `pieces` is called for every send of a request to a shard (a resend too), `answer` for every reply to
    it; the answers to a fragmented push are kept until the last fragment's has come, then given back as
    one PARAMS holding every chunk's values.
    """

    def __init__(self, budget: int = FRAGMENT_BYTES) -> None:
        if budget <= 0:
            raise ConfigError("fragment_bytes", f"must be > 0, got {budget!r}")
        self.budget = budget
        #: Shard -> (how many answers the request last sent there takes, the answers so far).
        self._answers: dict[int, tuple[int, list[Message]]] = {}
        #: Fragments sent (those of pushes sent whole not counted).
        self.sent = 0

    def pieces(self, shard: int, msg: Message, *, dense: bool) -> list[Message]:
        """What goes for `msg` to `shard`: its fragments when it is an async PUSH of `dense` values (no codec
        either way) answered with values, else `msg`. Any answers to what went before are void."""
        parted = (msg.op == "PUSH" and dense and "step" not in msg.meta
                  and msg.meta.get("reply", "values") == "values")
        out = fragments(msg, self.budget) if parted else [msg]
        self._answers[shard] = (len(out), [])
        self.sent += len(out) if len(out) > 1 else 0
        return out

    def most(self, nbytes: int) -> int:
        """The most fragments a push of `nbytes` goes as: a client's send queue takes them all back to back
        without blocking (views of the caller's gradients, no copies)."""
        return most_fragments(nbytes, self.budget)

    def answer(self, shard: int, reply: Message) -> Message | None:
        """The answer to the request in flight to `shard` once `reply` is in, or None while some of its
        fragments are unanswered. An ERROR answers for the whole push: nothing of it was applied."""
        expected, got = self._answers.get(shard, (1, []))
        if expected <= 1 or reply.op != "PARAMS":
            return reply
        got.append(reply)
        if len(got) < expected:
            return None
        del self._answers[shard]  # the caller holds the values now: nothing here keeps their frames
        return dataclasses.replace(reply, tensors={name: t for part in got for name, t in part.tensors.items()})
