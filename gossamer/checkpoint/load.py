"""Loading any checkpoint directory (a `model.pt` checkpoint or a sharded step) back as a state_dict."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gossamer.checkpoint.manifest import read_manifest
from gossamer.core.errors import CheckpointError


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint directory as a plain state_dict for `nn.Module.load_state_dict`.

    `path` is a `model.pt` checkpoint or a sharded step directory (`shard-*` subdirectories,
    see `gossamer.checkpoint.sharded`). The manifests' checksums are verified first; tensors
    are read with `weights_only=True`, so a checkpoint can never run code.

    Raises:
        CheckpointError: missing, partial or corrupt checkpoint.
    """
    import torch

    if any(p.is_dir() for p in Path(path).glob("shard-[0-9]*")):
        from gossamer.checkpoint.sharded import load_sharded_model  # torch at module level

        return load_sharded_model(path)
    read_manifest(path)
    try:
        state = torch.load(Path(path) / "model.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot read model.pt: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: model.pt does not hold a state_dict")
    return state
