"""A shard's replies to its clients over the ROUTER (PARAMS, ERROR, the other answers)."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import zmq

from gossamer.core.protocol import ErrorMeta
from gossamer.paramserver._pull_views import PullViews
from gossamer.paramserver._state import ShardState
from gossamer.transport.frames import Message, encode, frames_nbytes
from gossamer.transport.outgoing import OutgoingReplies, ReplyBudget, track
from gossamer.transport.router import Router, send_reply

__all__ = ["Replies"]

logger = logging.getLogger(__name__)


def _rid(rid: Any) -> Any:
    """A request id fit to echo (a hostile one is answered with None)."""
    return None if not isinstance(rid, int | str | None) or isinstance(rid, bool) else rid


class Replies:
    """Sends a shard's replies on its ROUTER (`router`, set by `bind`) and counts them.

    Every reply carries the replica's fencing epoch (`epoch_of`): a worker ignores replies from an
    older epoch than it knows. Sends never block: a reply to a full queue or a gone peer is
    dropped and counted in `dropped`. PARAMS replies are held against the router's reply budget
    (`outgoing`, handed to the router at bind) until ZMQ lets go of them.
    """

    def __init__(self, state: ShardState, views: PullViews, budget: ReplyBudget, dropped: Counter[str],
                 epoch_of: Callable[[], int] = lambda: 0) -> None:
        self.state = state
        self.views = views
        self.epoch_of = epoch_of
        self.router: Router | None = None
        self.dropped = dropped
        reply_bytes = 4 * sum(c.numel for c in state.chunks.values())
        self.outgoing = OutgoingReplies(budget, reply_bytes)
        self.bytes_out = 0
        self.raw_bytes_out = 0  # what the PARAMS replies would have been as full fp32 values
        self.errors = 0
        self._name = f"shard {state.config.shard}"

    def live_storages(self) -> set[int]:
        """The storages of the current values (replies referencing them cost no extra memory)."""
        return {p.data_ptr() for p in self.state.params.values()}

    def over_budget(self, identity: bytes) -> str | None:
        """Why `identity` may not get a PARAMS reply now (its or the server's reply budget), or None."""
        assert self.router is not None
        return self.router.over_budget(identity, self.live_storages())

    def send(self, identity: bytes, op: str, meta: dict[str, Any],
             tensors: dict[str, torch.Tensor] | None = None, *, live: bool = False, version: int | None = None,
             counted: bool = True) -> None:
        """Send a reply; `live`: its tensors are the state's own values, read by ZMQ after this
        returns, so the state is told (`lend`) until ZMQ has let go of them. `version`: the version
        it says (default: the state's). `counted` False: not one of the replies held for `identity`
        (`ReplyBudget.per_peer`): one of the answers to a push's fragments, all but the last."""
        config = self.state.config
        msg = Message(op=op, experiment=config.experiment, shard=config.shard,
                      version=self.state.version if version is None else version,
                      sender=f"shard-{config.shard}", meta={**meta, "epoch": self.epoch_of()}, tensors=tensors or {})
        frames: list[Any] = encode(msg)
        nbytes = frames_nbytes(frames)
        self.bytes_out += nbytes
        assert self.router is not None
        if not tensors:
            send_reply(self.router.socket, identity, frames, self.dropped)
            return
        # Tensor frames are tracked: the reply is held (`outgoing`) until ZMQ lets go of them.
        referenced = [isinstance(f, memoryview) for f in frames]
        frames, tracker = track(frames)
        shared: int | None = None
        lent = [f for f, ref in zip(frames, referenced, strict=True) if ref]
        if live and lent:  # only memoryview frames reference the values (small ones were copied)
            self.state.lend(zmq.MessageTracker(*lent))
            shared = next(iter(tensors.values())).data_ptr()
        self.router.send_tracked(identity, frames, tracker, nbytes, shared=shared, counted=counted)

    def params(self, identity: bytes, rid: Any, chunks: list[int], *, staleness: int | None = None,
               lead: int | None = None, version: int | None = None, counted: bool = True,
               values: dict[int, torch.Tensor] | None = None) -> None:
        """PARAMS: the current values of `chunks` (compressed differences for a pull codec); `version`,
        `counted` as `send`'s. `values`: these instead of the state's (a round's mean gradient, `ShardConfig.reduce`)."""
        meta, tensors, live = self.views.reply(identity, chunks, self.state.params if values is None else values,
                                               done=self.state.done, staleness=staleness, lead=lead)
        live = live and values is None
        if not self.state.config.barrier:  # what the worker's copy of these values holds (`ParamsMeta.applied`)
            meta = dataclasses.replace(meta, applied=dict(self.state.applied))
        elif self.state.config.reduce:
            meta = dataclasses.replace(meta, steps=self.state.steps)
        self.raw_bytes_out += sum(4 * self.state.chunks[idx].numel for idx in chunks)
        self.send(identity, "PARAMS", {"rid": rid, **meta.to_meta()}, tensors, live=live, version=version,
                  counted=counted)

    def error(self, identity: bytes, rid: Any, message: str, code: str) -> None:
        """ERROR: a request refused (counted in `errors`)."""
        self.errors += 1
        logger.warning("%s: rejected a request: %s (%s)", self._name, message, code)
        self.refusal(identity, rid, code, message)

    def refusal(self, identity: bytes, rid: Any, code: str, message: str) -> None:
        """ERROR to a request refused before it was decoded (the router's admission gate)."""
        try:
            self.send(identity, "ERROR", {"rid": _rid(rid), **ErrorMeta(error=message, code=code).to_meta()})
        except zmq.ZMQError as e:  # a closed socket at shutdown
            logger.warning("%s: could not send an error reply: %s", self._name, e)
