"""Atomic checkpoint directories: write to a temporary dir, fsync, rename; manifest.json with sha256."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gossamer.core.errors import CheckpointError
from gossamer.core.faults import die_at

MANIFEST = "manifest.json"
FORMAT = "gossamer-checkpoint/1"


def regular_file(path: Path) -> bool:
    """Whether `path` is a plain file itself (a symlink, FIFO or device is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (its directory entry is made durable apart)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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
                write_synced(tmp / name, blob)
                digest, size = hashlib.sha256(blob).hexdigest(), len(blob)
            entries[name] = {"sha256": digest, "bytes": size}
        manifest = {"format": FORMAT, "files": entries, "created_unix": time.time(), **meta}
        write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _aside_dirs(dest: Path) -> list[Path]:
    """Directories `replace_dir` moved `dest` aside to, newest first."""
    if not dest.parent.is_dir():
        return []
    prefix = f".{dest.name}.old-"
    found = [p for p in dest.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()]
    return sorted(found, key=lambda p: p.name.rsplit("-", 1)[-1], reverse=True)


def replace_dir(tmp: Path, dest: Path) -> None:
    """Put the complete directory `tmp` in place of `dest`, never deleting `dest` first.

    An existing `dest` is renamed aside (fsynced), `tmp` renamed into place (fsynced), and
    only then the old copy deleted. A crash between the two renames leaves no `dest` but
    the aside copy, which `recover_dir` (called by every loader) renames back; a crash
    after them leaves the new `dest` and a stale aside copy, which is deleted next time.
    """
    parent = dest.parent
    old: Path | None = None
    if dest.exists():
        old = parent / f".{dest.name}.old-{os.getpid()}-{time.time_ns()}"
        os.replace(dest, old)
        fsync_dir(parent)
        die_at("replace-aside", step=0)
    os.replace(tmp, dest)
    fsync_dir(parent)
    die_at("replace-swapped", step=0)
    for stale in _aside_dirs(dest):
        shutil.rmtree(stale, ignore_errors=True)


def recover_dir(dest: str | os.PathLike[str]) -> Path:
    """`dest`, renamed back from its aside copy if a replacement crashed between its renames."""
    dest = Path(dest)
    if not dest.exists():
        for aside in _aside_dirs(dest):
            if (aside / MANIFEST).is_file():
                try:
                    os.replace(aside, dest)
                except FileNotFoundError:
                    continue  # another loader renamed it back first
                fsync_dir(dest.parent)
                break
    return dest


def read_manifest(path: str | os.PathLike[str], verify: bool = True) -> dict[str, Any]:
    """Read and (by default) verify a checkpoint's manifest; CheckpointError if anything is off."""
    path = recover_dir(path)
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
