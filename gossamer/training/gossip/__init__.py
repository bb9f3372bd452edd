"""Gossip mode: push-sum (SGP) peers over ZMQ and the time-varying graphs they talk on."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gossamer.training.gossip.topology import TOPOLOGIES, out_peer

if TYPE_CHECKING:
    from gossamer.training.gossip.pushsum import MixStats, PushSumPeer, Snapshot
    from gossamer.training.gossip.value_codec import GOSSIP_CODECS, parse_value_codec

__all__ = [
    "GOSSIP_CODECS",
    "TOPOLOGIES",
    "MixStats",
    "PushSumPeer",
    "Snapshot",
    "out_peer",
    "parse_value_codec",
]

# Loaded on first use, so torch-free processes (the coordinator checking a topology) can
# import this package without importing torch.
_LAZY = {
    "MixStats": "pushsum",
    "PushSumPeer": "pushsum",
    "Snapshot": "pushsum",
    "GOSSIP_CODECS": "value_codec",
    "parse_value_codec": "value_codec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"gossamer.training.gossip.{module}"), name)
