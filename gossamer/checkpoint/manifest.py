"""Atomic checkpoint directories: write to a temporary dir, fsync, rename; manifest.json with sha256."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
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


def _sha256_of(path: Path) -> tuple[str, int]:
    """sha256 and size of a file, read in 1 MiB pieces."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def write_atomic_dir(dest: str | os.PathLike[str], files: dict[str, bytes | Callable[[Path], None]],
                     meta: dict[str, Any]) -> Path:
    """Write `files` into `dest` atomically, with a manifest of their sha256 sums.

    A file is its bytes, or a callable that writes it at the path it is given (a model's
    tensors streamed to disk, never held as one more copy in memory). The directory appears
    complete or not at all: files go to `dest.tmp-*`, are fsynced, the manifest is written
    last, then the directory is renamed into place.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    entries = {}
    try:
        for name, blob in files.items():
            if callable(blob):
                blob(tmp / name)
                with open(tmp / name, "rb+") as f:
                    os.fsync(f.fileno())
                digest, size = _sha256_of(tmp / name)
            else:
                with open(tmp / name, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                digest, size = hashlib.sha256(blob).hexdigest(), len(blob)
            entries[name] = {"sha256": digest, "bytes": size}
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

    # One copy of each tensor (its own storage: a view of a flat buffer would save the whole
    # buffer), written straight to the file: no serialised copy in memory beside it.
    tensors = {k: v.detach().cpu().clone() for k, v in state_dict.items()}
    return write_atomic_dir(dest, {"model.pt": lambda path: torch.save(tensors, path)}, meta)
