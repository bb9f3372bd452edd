"""DCP's part of a shard checkpoint: writing its tensors and reading them back, imported on first use.

torch.distributed.checkpoint costs 1.2 s of imports here: a role imports it with its first save or
load, not before its first step (a fresh node's fork server imports it after the role code).
"""

from __future__ import annotations

import enum
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import WriteItem

from gossamer.checkpoint.manifest import MANIFEST, regular_file
from gossamer.checkpoint.piece_stream import Pieces, PieceStream
from gossamer.core.errors import CheckpointError

__all__ = ["load_pieces", "save_pieces"]

_WRITERS = 2  # DCP's writer threads: 800 MB to the page cache in 0.63 s against 1.04 s with one, on this host

# DCP warns on every call without a process group, even when no_dist=True asks for exactly that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class _StreamPlanner(DefaultSavePlanner):
    """DCP's default planner, each tensor read from the snapshot's stream as it is written."""

    def __init__(self, stream: PieceStream) -> None:
        super().__init__()
        self._stream = stream
        self._last: dict[int, tuple[int, str]] = {}  # by writer thread: the tensor it asked for last

    def resolve_data(self, write_item: WriteItem) -> Any:
        # Each of DCP's writer threads writes one tensor at a time, in its file's order: asked for
        # its next one, the one before is in its file.
        thread = threading.get_ident()
        self._written(thread)
        name, _, off = write_item.index.fqn.rpartition("/")
        self._last[thread] = (int(off), name)
        return self._stream.take(int(off), name)

    def _written(self, thread: int) -> None:
        last = self._last.pop(thread, None)
        if last is not None:
            self._stream.written(*last)

    def finish(self) -> None:
        """The last tensors asked for are in their files (DCP returned)."""
        for thread in list(self._last):
            self._written(thread)


def save_pieces(state: dict[str, torch.Tensor], tmp: Path, stream: PieceStream | None) -> None:
    """DCP-save `state` into the directory `tmp`; with a `stream`, each tensor read from it as it is written."""
    planner = _StreamPlanner(stream) if stream is not None else None
    try:
        # Not fsynced here: the caller fsyncs every file (the data, then .metadata) as it hashes it. Two
        # writer threads, two files: a streamed snapshot is written (and its tensors released) sooner.
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=False, thread_count=_WRITERS),
                 planner=planner, no_dist=True)
    except CheckpointException as e:
        raise CheckpointError(f"{tmp}: DCP save failed: {_dcp_cause(e)}") from e
    finally:
        if planner is not None:
            planner.finish()


def _dcp_cause(e: BaseException) -> str:
    """The underlying error of a DCP CheckpointException (whose str is a whole traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return f"{type(e).__name__}: {e}"


_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


def _enum_member(cls: object, name: object) -> Any:
    """`getattr(cls, name)` as a pickle of an Enum member spells it on Python 3.11.0 to 3.11.4
    (Debian 12's 3.11.2 among them; later versions pickle the value): only a member of one of
    DCP's metadata enums, never an attribute of anything else (`getattr(PosixPath, "unlink")`
    would hand the pickle a function to call)."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == _DCP_METADATA
            and isinstance(name, str) and name in cls.__members__):
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not allowed "
                                 "in checkpoint metadata")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` allowing only its metadata classes and enum members, sizes, dtypes and paths."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _enum_member
        if "." not in name:
            if (module, name) in _SAFE_GLOBALS:
                return super().find_class(module, name)
            obj = getattr(torch, name, None) if module == "torch" else None
            if isinstance(obj, torch.dtype):
                return obj
            if module == _DCP_METADATA:
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata cannot run code or name files outside the shard.

    DCP itself uses plain pickle.load, and opens whatever relative path the metadata gives
    (an absolute path, `..`, a FIFO would be read as named). Here every storage entry must
    name a bare file name listed in the shard's manifest (so sha256-verified) that is a
    regular file.
    """

    def __init__(self, path: Path, listed: set[str]) -> None:
        super().__init__(path)
        self.listed = listed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        if ".metadata" not in self.listed or not regular_file(path):
            raise CheckpointError(f"{path}: not a regular file listed in the manifest")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path}/.metadata holds no DCP Metadata")
        _check_storage(Path(self.path), metadata, self.listed)
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata


def _check_storage(shard_dir: Path, metadata: Metadata, listed: set[str]) -> None:
    """CheckpointError unless every storage entry of `metadata` names a listed regular file."""
    where = shard_dir / ".metadata"
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..", MANIFEST, ".metadata") \
                or any(c in name for c in "/\\\0"):
            raise CheckpointError(f"{where}: refused, it names {name!r}; only bare file names listed in "
                                  "the manifest are allowed")
        if name not in listed:
            raise CheckpointError(f"{where}: refused, it names {name!r}, which the manifest does not list")
        if not regular_file(shard_dir / name):
            raise CheckpointError(f"{where}: refused, {name!r} is not a regular file")


def load_pieces(shard_dir: Path, pieces: Pieces, listed: set[str]) -> dict[str, torch.Tensor]:
    """DCP-load the named pieces of one shard into tensors of their saved shape."""
    state = {f"{k}/{off}": torch.empty(n) for off, n, names in pieces for k in names}
    reader = _SafeReader(shard_dir, listed)
    try:
        reader.read_metadata()  # refused here with its own message, not inside DCP's wrapping
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 — a damaged or crafted pickle raises anything
        raise CheckpointError(f"{shard_dir}: DCP load failed: {type(e).__name__}: {e}") from e
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (CheckpointException, Exception) as e:
        raise CheckpointError(f"{shard_dir}: DCP load failed: {_dcp_cause(e)}") from e
    return state
