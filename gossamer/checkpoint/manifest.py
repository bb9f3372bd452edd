"""Atomic checkpoint directories: write to a temporary dir, fsync, rename; manifest.json with sha256."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from gossamer.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "gossamer-checkpoint/1"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic_dir(dest: str | os.PathLike[str], files: dict[str, bytes], meta: dict[str, Any]) -> Path:
    """Write `files` into `dest` atomically, with a manifest of their sha256 sums.

    The directory appears complete or not at all: files go to `dest.tmp-*`, are fsynced,
    the manifest is written last, then the directory is renamed into place.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    entries = {}
    try:
        for name, blob in files.items():
            with open(tmp / name, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            entries[name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
        manifest = {"format": FORMAT, "files": entries, "created_unix": time.time(), **meta}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def read_manifest(path: str | os.PathLike[str], verify: bool = True) -> dict[str, Any]:
    """Read and (by default) verify a checkpoint's manifest; CheckpointError if anything is off."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} has no {MANIFEST}: not a checkpoint, or a partial one") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / MANIFEST} is corrupt: {e}") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    if verify:
        for name, entry in manifest["files"].items():
            try:
                blob = (path / name).read_bytes()
            except FileNotFoundError as e:
                raise CheckpointError(f"{path}: file {name} listed in the manifest is missing") from e
            if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
                raise CheckpointError(f"{path / name}: sha256 mismatch (corrupt or truncated)")
    return manifest


def save_model_checkpoint(dest: str | os.PathLike[str], state_dict: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Save a model state_dict (tensors) as `model.pt` in an atomic checkpoint directory."""
    import torch

    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().clone() for k, v in state_dict.items()}, buf)
    return write_atomic_dir(dest, {"model.pt": buf.getvalue()}, meta)


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
        from gossamer.checkpoint.sharded import load_sharded_model  # it imports this module

        return load_sharded_model(path)
    read_manifest(path)
    try:
        state = torch.load(Path(path) / "model.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: cannot read model.pt: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: model.pt does not hold a state_dict")
    return state
