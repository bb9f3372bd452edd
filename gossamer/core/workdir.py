"""A user's code directory shipped with an experiment: packed (deterministic tar.gz), content-hashed, unpacked into a private cache."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gossamer.core.errors import ConfigError

__all__ = ["CHUNK_BYTES", "SKIPPED", "Packed", "digest_of", "is_digest", "pack", "unpack"]

#: Directories and files never shipped: caches, version control, virtual environments.
SKIPPED = frozenset({"__pycache__", ".git", ".hg", ".svn", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                     ".ruff_cache", ".tox", ".ipynb_checkpoints", "node_modules", ".DS_Store", ".eggs"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo")
#: Bytes per gRPC message of an upload or a fetch (well under the coordinator's message limit).
CHUNK_BYTES = 1 << 20
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def is_digest(text: str) -> bool:
    """Whether `text` names packed content ("sha256:" and 64 lowercase hex digits)."""
    return bool(_DIGEST.fullmatch(text))


def digest_of(data: IO[bytes]) -> str:
    """"sha256:<hex>" of what `data` holds from its start (left at its end)."""
    data.seek(0)
    h = hashlib.sha256()
    for block in iter(lambda: data.read(CHUNK_BYTES), b""):
        h.update(block)
    return f"sha256:{h.hexdigest()}"


@dataclass
class Packed:
    """A packed directory: the archive (a file object at its start), its digest, size and file count."""

    data: IO[bytes]
    digest: str
    size: int
    files: int

    def chunks(self) -> Iterator[bytes]:
        self.data.seek(0)
        yield from iter(lambda: self.data.read(CHUNK_BYTES), b"")


def _shipped(root: Path) -> Iterator[Path]:
    """Regular files and directories under `root` in sorted order, skipping `SKIPPED` and symlinks."""
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name in SKIPPED or entry.name.endswith(_SKIPPED_SUFFIXES) or entry.is_symlink():
            continue
        if entry.is_dir():
            yield entry
            yield from _shipped(entry)
        elif entry.is_file():
            yield entry


def pack(directory: str | os.PathLike[str]) -> Packed:
    """The files of `directory` as a tar.gz whose bytes depend only on their names, contents and
    executable bits (sorted, times and owners zeroed), so the same code has the same digest.

    Raises:
        ConfigError: `directory` is not a directory (field `workdir`).
    """
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError("workdir", f"{str(directory)!r} is not a directory")
    out: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 — handed to the caller
    files = 0
    # gzip's header holds a time and a name: both fixed, or the digest would change with the clock.
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _shipped(root):
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
                continue
            executable = path.stat().st_mode & stat.S_IXUSR
            info.mode, info.size = (0o755 if executable else 0o644), path.stat().st_size
            with path.open("rb") as f:
                tar.addfile(info, f)
            files += 1
    size = out.tell()
    return Packed(data=out, digest=digest_of(out), size=size, files=files)


def unpack(archive: str | os.PathLike[str], digest: str, cache: str | os.PathLike[str]) -> Path:
    """`archive` unpacked as `cache/<hex of digest>` (owner-only), the directory returned.

    Checked against `digest` first; unpacked into a temporary directory beside it and renamed
    into place, so a reader sees all of it or nothing, and two unpackers racing both succeed.
    Only regular files and directories inside the target are taken.

    Raises:
        ValueError: the archive's digest is not `digest`, or it holds a link, a device or a
            path leading outside.
    """
    root = Path(cache)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = root / digest.removeprefix("sha256:")
    if target.is_dir():
        return target
    with open(archive, "rb") as f:
        found = digest_of(f)
    if found != digest:
        raise ValueError(f"the archive's digest is {found}, not {digest}")
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))  # mode 0700
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar:
                _extract(tar, member, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not another unpacker's win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, into: Path) -> None:
    dest = (into / member.name).resolve()
    if not dest.is_relative_to(into.resolve()) or dest == into.resolve():
        raise ValueError(f"the archive's entry {member.name!r} leads outside its directory")
    if member.isdir():
        dest.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    if not member.isfile():
        raise ValueError(f"the archive's entry {member.name!r} is not a regular file or directory")
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    src = tar.extractfile(member)
    assert src is not None  # a regular file's
    with src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, io.DEFAULT_BUFFER_SIZE * 16)
    os.chmod(dest, 0o700 if member.mode & stat.S_IXUSR else 0o600)
