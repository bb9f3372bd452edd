"""Pull compression on a shard: what each worker holds of every chunk, so replies carry compressed differences."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import ConfigError
from gossamer.core.protocol import ParamsMeta, chunk_key
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver._reject import Reject

__all__ = ["PullViews"]


class PullViews:
    """Per-sender views of the chunks, for the workers that asked for a pull codec.

    Each view costs up to a copy of the shard, so views are kept only for current members
    (the shard's `Updates.may_keep_view`) and freed when their sender leaves, is removed from
    the membership, or expires (`worker_timeout_s`).

    A reply to such a worker carries the compressed difference between the current values
    and its view; the view then advances by exactly what the worker decodes, so what a lossy
    codec dropped stays in the next difference (error feedback through the view). Not locked:
    the shard server calls it under its lock.
    """

    def __init__(self, plan: ShardPlan, shapes: dict[str, tuple[int, ...]]) -> None:
        self.plan = plan
        self.shapes = shapes
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._encoders: dict[str, ChunkCompressor] = {}
        self._pull_of: dict[bytes, tuple[str, str]] = {}  # ZMQ identity -> (sender, pull codec)

    def note_codec(self, identity: bytes, sender: str, spec: str, *, keep_view: bool = True) -> None:
        """The pull codec the connection `identity` of `sender` asked for ("none": full values).

        `keep_view` False (the sender is not a current member): full values, and nothing kept.
        """
        if spec == "none" or not keep_view:
            self._pull_of.pop(identity, None)
            return
        if spec not in self._encoders:
            try:
                self._encoders[spec] = ChunkCompressor(spec, self.plan, error_feedback=False, shapes=self.shapes)
            except ConfigError as e:
                raise Reject(f"pull_codec: {e}") from None
        if not sender:
            raise Reject("pull compression needs a sender id")
        self._pull_of[identity] = (sender, spec)

    def restart(self, sender: str, chunks: list[int]) -> None:
        """A PULL restarts the worker's view of `chunks`: full values follow."""
        for idx in chunks:
            self._views.pop((sender, idx), None)

    def senders(self) -> int:
        """Senders holding a view (each costs up to a copy of the shard)."""
        return len({sender for sender, _ in self._views})

    def forget(self, sender: str) -> None:
        """`sender` left: its views go."""
        self.retain(lambda s: s != sender)

    def retain(self, keep: Callable[[str], bool]) -> None:
        """Keep the views (and connections' codecs) of the senders `keep` accepts; free the rest."""
        for key in [k for k in self._views if not keep(k[0])]:
            del self._views[key]
        for identity in [i for i, (sender, _) in self._pull_of.items() if not keep(sender)]:
            del self._pull_of[identity]

    def clear(self) -> None:
        """The values were rolled back: every worker starts from full values again."""
        self._views.clear()

    def reply(self, identity: bytes, chunks: list[int], params: dict[int, torch.Tensor], *, done: bool,
              staleness: int | None = None,
              lead: int | None = None) -> tuple[ParamsMeta, dict[str, torch.Tensor], bool]:
        """The PARAMS reply to `identity` for `chunks`: full values or compressed differences.

        The third item says the tensors are the live values themselves (full values, no copy):
        the send must be tracked, and the state copies them aside before its next write if
        the send is still reading them (`ShardState.lend`).
        """
        tensors: dict[str, torch.Tensor] = {}
        pull = self._pull_of.get(identity)
        if pull is None:
            tensors = {chunk_key(idx): params[idx].detach() for idx in chunks}
            return ParamsMeta(done=done, staleness=staleness, lead=lead), tensors, True
        sender, spec = pull
        encoder = self._encoders[spec]
        compressed: dict[str, Any] = {}
        for idx in chunks:
            current = params[idx]
            view = self._views.get((sender, idx))
            wire = None
            if view is not None:
                try:
                    wire, cmeta = encoder.encode(idx, current - view)
                except ValueError:  # the difference overflows fp32 (values near its max): whole values
                    wire = None
            if view is None or wire is None:  # first contact (or overflow): full values, and they become the view
                tensors[chunk_key(idx)] = current.clone()
                self._views[(sender, idx)] = current.clone()
                continue
            view.add_(encoder.decode(idx, wire, cmeta))
            tensors.update(wire)
            compressed[str(idx)] = cmeta
        meta = ParamsMeta(done=done, staleness=staleness, lead=lead, pull_compression=compressed or None,
                          codec=spec if compressed else None)
        return meta, tensors, False
