"""A coordinator's workdir store bounds what uploads in progress hold: how many at once, their bytes, a stalled sender."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gossamer.coordinator.workdirs import WorkdirStore
from gossamer.core.errors import UnavailableError
from gossamer.v1 import coordinator_pb2 as pb

_MIB = 1 << 20


def _blob(seed: int, size: int) -> tuple[str, bytes]:
    data = bytes([seed % 251]) * size
    return f"sha256:{hashlib.sha256(data).hexdigest()}", data


async def _pieces(data: bytes, digest: str, hold: asyncio.Event | None = None) -> AsyncIterator[pb.WorkdirChunk]:
    """The upload's pieces of 256 KiB; with `hold`, it waits on it after the first piece (a slow or stalled sender)."""
    step = 256 << 10
    yield pb.WorkdirChunk(digest=digest, size=len(data), data=data[:step])
    if hold is not None:
        await hold.wait()
    for i in range(step, len(data), step):
        yield pb.WorkdirChunk(data=data[i : i + step])


def _store(root: Path, **kw: object) -> WorkdirStore:
    return WorkdirStore(root, max_bytes=kw.pop("max_bytes", 2 * _MIB), total_bytes=kw.pop("total_bytes", 64 * _MIB),  # type: ignore[arg-type]
                        in_use=set, **kw)  # type: ignore[arg-type]


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".upload-*")) if root.is_dir() else []


def test_uploads_past_the_bound_are_refused_while_the_others_go_on(tmp_path: Path) -> None:
    async def main() -> None:
        store = _store(tmp_path, max_uploads=2)
        hold = asyncio.Event()
        blobs = [_blob(i, _MIB) for i in range(3)]
        first = [asyncio.ensure_future(store.receive(_pieces(data, digest, hold))) for digest, data in blobs[:2]]
        while len(_leftovers(tmp_path)) < 2:  # both are receiving
            await asyncio.sleep(0.01)
        with pytest.raises(UnavailableError, match="2 uploads are in progress"):
            await store.receive(_pieces(blobs[2][1], blobs[2][0]))
        hold.set()
        for (digest, _), done in zip(blobs, first, strict=False):
            assert (await done).digest == digest and store.has(digest)
        assert not (await store.receive(_pieces(blobs[2][1], blobs[2][0]))).already_stored  # a slot again
        assert _leftovers(tmp_path) == []

    asyncio.run(main())


def test_the_bytes_of_uploads_in_progress_count_against_the_store(tmp_path: Path) -> None:
    async def main() -> None:
        store = _store(tmp_path, total_bytes=3 * _MIB)
        hold = asyncio.Event()
        (d1, b1), (d2, b2) = _blob(1, 2 * _MIB), _blob(2, 2 * _MIB)
        receiving = asyncio.ensure_future(store.receive(_pieces(b1, d1, hold)))
        while not _leftovers(tmp_path):
            await asyncio.sleep(0.01)
        with pytest.raises(UnavailableError, match="fill this coordinator's store"):
            await store.receive(_pieces(b2, d2))  # 2 MiB stored-to-be + 2 MiB > 3 MiB
        hold.set()
        assert (await receiving).digest == d1

    asyncio.run(main())


def test_a_sender_that_stops_is_dropped_and_leaves_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        store = _store(tmp_path, max_uploads=1, piece_timeout_s=0.3)
        digest, data = _blob(3, _MIB)
        with pytest.raises(UnavailableError, match="sent no piece for 0.3 s"):
            await store.receive(_pieces(data, digest, asyncio.Event()))  # never set: it stalls after one piece
        assert _leftovers(tmp_path) == [] and not store.has(digest)
        assert (await store.receive(_pieces(data, digest))).digest == digest  # its slot was given back

    asyncio.run(main())
    assert not any(name.startswith(".upload-") for name in os.listdir(tmp_path))
