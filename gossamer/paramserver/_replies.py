"""A shard's replies to its clients over the ROUTER (PARAMS, ERROR, the other answers)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import zmq

from gossamer.paramserver._pull_views import PullViews
from gossamer.paramserver._state import ShardState
from gossamer.protocol import ErrorMeta
from gossamer.transport.frames import Message, encode, frames_nbytes

__all__ = ["Replies"]

logger = logging.getLogger(__name__)


def _rid(rid: Any) -> Any:
    """A request id fit to echo (a hostile one is answered with None)."""
    return None if not isinstance(rid, int | str | None) or isinstance(rid, bool) else rid


class Replies:
    """Sends a shard's replies on its ROUTER socket (set by `bind`) and counts them.

    Every reply carries the replica's fencing epoch (`epoch_of`): a worker ignores replies from an
    older epoch than it knows.
    """

    def __init__(self, state: ShardState, views: PullViews, epoch_of: Callable[[], int] = lambda: 0) -> None:
        self.state = state
        self.views = views
        self.epoch_of = epoch_of
        self.socket: zmq.Socket | None = None
        self.bytes_out = 0
        self.raw_bytes_out = 0  # what the PARAMS replies would have been as full fp32 values
        self.errors = 0
        self._name = f"shard {state.config.shard}"

    def send(self, identity: bytes, op: str, meta: dict[str, Any],
             tensors: dict[str, torch.Tensor] | None = None, *, live: bool = False) -> None:
        """Send a reply; `live`: its tensors are the state's own values, read by ZMQ after this
        returns, so the state is told (`lend`) until ZMQ has let go of them."""
        config = self.state.config
        msg = Message(op=op, experiment=config.experiment, shard=config.shard, version=self.state.version,
                      sender=f"shard-{config.shard}", meta={**meta, "epoch": self.epoch_of()}, tensors=tensors or {})
        frames: list[Any] = encode(msg)
        self.bytes_out += frames_nbytes(frames)
        assert self.socket is not None
        if live:
            # Only memoryview frames reference the values (small tensors were copied to bytes).
            frames = [zmq.Frame(f, track=True) if isinstance(f, memoryview) else f for f in frames]
            tracked = [f for f in frames if isinstance(f, zmq.Frame)]
            if tracked:
                self.state.lend(zmq.MessageTracker(*tracked))
        self.socket.send_multipart([identity, *frames], copy=False)

    def params(self, identity: bytes, rid: Any, chunks: list[int], *, staleness: int | None = None,
               lead: int | None = None) -> None:
        """PARAMS: the current values of `chunks` (compressed differences for a pull codec)."""
        meta, tensors, live = self.views.reply(identity, chunks, self.state.params, done=self.state.done,
                                               staleness=staleness, lead=lead)
        self.raw_bytes_out += sum(4 * self.state.chunks[idx].numel for idx in chunks)
        self.send(identity, "PARAMS", {"rid": rid, **meta.to_meta()}, tensors, live=live)

    def error(self, identity: bytes, rid: Any, message: str, code: str) -> None:
        """ERROR: a request refused (counted in `errors`)."""
        self.errors += 1
        logger.warning("%s: rejected a request: %s (%s)", self._name, message, code)
        self.refusal(identity, rid, code, message)

    def refusal(self, identity: bytes, rid: Any, code: str, message: str) -> None:
        """ERROR to a request refused before it was decoded (the router's admission gate)."""
        try:
            self.send(identity, "ERROR", {"rid": _rid(rid), **ErrorMeta(error=message, code=code).to_meta()})
        except zmq.ZMQError as e:
            logger.warning("%s: could not send an error reply: %s", self._name, e)
