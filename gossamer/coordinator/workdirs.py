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
#: Uploads received at once: each holds a temporary file of up to `max_bytes` until it ends.
MAX_UPLOADS = 4
#: The longest wait for an upload's next piece: a client that stops sending gives its slot back.
PIECE_TIMEOUT_S = 60.0


def _mib(n: int) -> str:
    return f"{n / _MIB:.1f} MiB ({n} bytes)"


class WorkdirStore:
    """Archives under `root/<hex>.tar.gz`, each checked against its digest as it arrives.

    One archive is at most `max_bytes` (refused at upload, naming its size); all of them at most
    `total_bytes`, the uploads in progress counted at their stated size: an upload past that first
    drops archives no active experiment names (oldest first), and is refused if that is not enough.
    At most `max_uploads` are received at once (the next is refused, UNAVAILABLE), and one whose
    next piece takes longer than `piece_timeout_s` is dropped. `in_use` says which digests the
    active experiments name.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int, total_bytes: int,
                 in_use: Callable[[], set[str]], max_uploads: int = MAX_UPLOADS,
                 piece_timeout_s: float = PIECE_TIMEOUT_S) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.total_bytes = total_bytes
        self.max_uploads = max_uploads
        self.piece_timeout_s = piece_timeout_s
        self._in_use = in_use
        self._unpacking: dict[str, asyncio.Future[Path]] = {}
        self._receiving: dict[object, int] = {}  # an upload in progress -> its stated size

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
        """Store an upload.

        Raises:
            ConfigError: (field workdir) over the cap, or bytes not matching the digest.
            UnavailableError: `max_uploads` in progress, the store full of active experiments' archives,
                or the client stopped sending.
        """
        stream = aiter(pieces)
        first = await self._next(stream)
        if first is None or not is_digest(first.digest):
            raise ConfigError("workdir", "an upload starts with the archive's digest ('sha256:<hex>')")
        self._refuse_size(first.size)
        digest, size = first.digest, first.size
        if self.has(digest):
            return pb.UploadWorkdirResponse(digest=digest, size=size, already_stored=True)
        if len(self._receiving) >= self.max_uploads:
            raise UnavailableError(f"{len(self._receiving)} uploads are in progress on this coordinator (at most "
                                   f"{self.max_uploads} at once); submit again in a moment")
        upload = object()
        self._receiving[upload] = size
        try:
            await asyncio.to_thread(self._make_room, size, sum(self._receiving.values()) - size)
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            await self._write(first, stream, digest, size)
        finally:
            del self._receiving[upload]
        log.info("stored workdir %s (%s)", digest, _mib(size))
        return pb.UploadWorkdirResponse(digest=digest, size=size, already_stored=False)

    async def _next(self, stream: AsyncIterator[pb.WorkdirChunk]) -> pb.WorkdirChunk | None:
        try:
            return await asyncio.wait_for(anext(stream, None), self.piece_timeout_s)
        except asyncio.TimeoutError:  # noqa: UP041 - TimeoutError's alias on 3.11, not on 3.10
            raise UnavailableError(f"the upload sent no piece for {self.piece_timeout_s:g} s; dropped") from None

    async def _write(self, first: pb.WorkdirChunk, stream: AsyncIterator[pb.WorkdirChunk], digest: str,
                     size: int) -> None:
        """The pieces into a temporary file, checked, then renamed to the archive's place (removed on any failure)."""
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
                    piece = await self._next(stream)
            if f"sha256:{h.hexdigest()}" != digest or got != size:
                raise ConfigError("workdir", f"the upload's {got} bytes do not match its digest {digest} and size {size}")
            os.replace(tmp, self.path(digest))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _make_room(self, size: int, receiving: int = 0) -> None:
        """Drop archives no active experiment names, oldest first, until `size` more fits in `total_bytes`
        beside the stored ones and the `receiving` bytes of the other uploads in progress."""
        stored = sorted(self.root.glob("*.tar.gz"), key=lambda p: p.stat().st_mtime) if self.root.is_dir() else []
        used = receiving + sum(p.stat().st_size for p in stored)
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
