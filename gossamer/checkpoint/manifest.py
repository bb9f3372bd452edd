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


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in directory `path` durable."""
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
        fsync_dir(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
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
