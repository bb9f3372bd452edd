"""The code directories experiments ship (`submit --workdir`): stored once per digest, capped, bounded in total."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from gossamer.core.errors import ConfigError, NotFoundError, UnavailableError
from gossamer.core.workdir import CHUNK_BYTES, is_digest, unpack
from gossamer.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

_MIB = float(1 << 20)


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB ({n} bytes)"


class WorkdirStore:
    """Archives under `root/<hex>.tar.gz`, each checked against its digest as it arrives.

    One archive is at most `max_bytes` (refused at upload, naming its size); all of them at most
    `total_bytes`: an upload past that first drops archives no active experiment names (oldest
    first), and is refused if that is not enough. `in_use` says which digests the active
    experiments name.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int, total_bytes: int,
                 in_use: Callable[[], set[str]]) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.total_bytes = total_bytes
        self._in_use = in_use
        self._unpacking: dict[str, asyncio.Future[Path]] = {}

    def path(self, digest: str) -> Path:
        return self.root / f"{digest.removeprefix('sha256:')}.tar.gz"

    def has(self, digest: str) -> bool:
        return is_digest(digest) and self.path(digest).is_file()

    def _refuse_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise ConfigError("workdir", f"the packed directory is {_mib(size)}, over this coordinator's cap of "
                                         f"{_mib(self.max_bytes)} (coordinator serve --workdir-max-mib); ship "
                                         "the code only (data belongs to the dataset), or an image with it "
                                         "(docs/deploy.md)")

    async def receive(self, pieces: AsyncIterator[pb.WorkdirChunk]) -> pb.UploadWorkdirResponse:
        """Store an upload. Raises ConfigError (field workdir): over the cap, or bytes not matching the digest."""
        first = await anext(aiter(pieces), None)
        if first is None or not is_digest(first.digest):
            raise ConfigError("workdir", "an upload starts with the archive's digest ('sha256:<hex>')")
        self._refuse_size(first.size)
        digest, size = first.digest, first.size
        if self.has(digest):
            return pb.UploadWorkdirResponse(digest=digest, size=size, already_stored=True)
        await asyncio.to_thread(self._make_room, size)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".upload-", dir=self.root)
        h, got = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as out:
                piece: pb.WorkdirChunk | None = first
                while piece is not None:
                    got += len(piece.data)
                    self._refuse_size(got)  # a client that understated the size
                    h.update(piece.data)
                    out.write(piece.data)
                    piece = await anext(aiter(pieces), None)
            if f"sha256:{h.hexdigest()}" != digest or got != size:
                raise ConfigError("workdir", f"the upload's {got} bytes do not match its digest {digest} and size {size}")
            os.replace(tmp, self.path(digest))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("stored workdir %s (%s)", digest, _mib(size))
        return pb.UploadWorkdirResponse(digest=digest, size=size, already_stored=False)

    def _make_room(self, size: int) -> None:
        """Drop archives no active experiment names, oldest first, until `size` more fits in `total_bytes`."""
        stored = sorted(self.root.glob("*.tar.gz"), key=lambda p: p.stat().st_mtime) if self.root.is_dir() else []
        used = sum(p.stat().st_size for p in stored)
        keep = {d.removeprefix("sha256:") for d in self._in_use()}
        for p in stored:
            if used + size <= self.total_bytes:
                break
            if p.name.removesuffix(".tar.gz") in keep:
                continue
            used -= p.stat().st_size
            p.unlink(missing_ok=True)
            shutil.rmtree(self.root / "unpacked" / p.name.removesuffix(".tar.gz"), ignore_errors=True)
            log.info("dropped workdir sha256:%s (no active experiment names it; store over its bound)",
                     p.name.removesuffix(".tar.gz"))
        if used + size > self.total_bytes:
            raise UnavailableError(f"the workdirs of active experiments fill this coordinator's store "
                                   f"({_mib(used)} of {_mib(self.total_bytes)}, --workdir-store-mib); "
                                   "submit again when one ends")

    async def pieces(self, digest: str) -> AsyncIterator[pb.WorkdirChunk]:
        """The stored archive in pieces (read in a thread), the first naming its digest and size.

        Raises:
            NotFoundError: not stored.
        """
        try:
            f = self.path(digest).open("rb")
        except FileNotFoundError:
            raise NotFoundError(f"workdir {digest} is not stored on this coordinator") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            data = await asyncio.to_thread(f.read, CHUNK_BYTES)
            yield pb.WorkdirChunk(digest=digest, size=size, data=data)
            while data := await asyncio.to_thread(f.read, CHUNK_BYTES):
                yield pb.WorkdirChunk(data=data)

    async def unpacked(self, digest: str) -> Path:
        """The stored archive unpacked under `root/unpacked/` (for the submit-time import check)."""
        pending = self._unpacking.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(unpack, self.path(digest), digest, self.root / "unpacked"))
            self._unpacking[digest] = pending
            pending.add_done_callback(lambda _f: self._unpacking.pop(digest, None))
        return await asyncio.shield(pending)
