"""A node's cache of the code directories its experiments ship: fetched from the coordinator once per digest, unpacked owner-only."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import grpc

from gossamer.core.workdir import is_digest, unpack
from gossamer.node.launcher import ensure_run_dir
from gossamer.v1 import coordinator_pb2 as pb
from gossamer.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: Unpacked directories kept beyond those the current assignments name (least recently used dropped).
KEEP = 8
FETCH_TIMEOUT_S = 300.0


def workdir_of(a: pb.Assignment) -> str:
    """The digest of the code directory `a`'s experiment ships ("": none)."""
    try:
        digest = json.loads(a.experiment_json).get("workdir", "")
    except (ValueError, AttributeError):
        return ""  # the role reports what is wrong with its experiment
    return digest if isinstance(digest, str) and is_digest(digest) else ""


class WorkdirCache:
    """`root/<hex>/`: each a shipped directory as unpacked (mode 0700, files 0600), put in place by a rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, digest: str) -> str:
        """Where `digest` is unpacked ("" for no digest)."""
        return str(self.root / digest.removeprefix("sha256:")) if digest else ""

    async def ready(self, stub: pb_grpc.NodeServiceStub, node_id: str,
                    assignments: list[pb.Assignment]) -> list[pb.Assignment]:
        """`assignments` whose code directory is here, fetching the missing ones; a role whose
        directory cannot be fetched is reported FAILED (saying why) and left out."""
        out = []
        for a in assignments:
            digest = workdir_of(a)
            if digest and not Path(self.path(digest)).is_dir():
                try:
                    await self._fetch(stub, node_id, a.experiment_id, digest)
                except (grpc.RpcError, OSError, ValueError) as e:
                    why = f"fetching its workdir {digest[:19]} failed: {_reason(e)}"
                    log.error("%s %d of %s: %s", pb.Role.Name(a.role), a.index, a.experiment_id, why)
                    await _report_failed(stub, node_id, a, why)
                    continue
            if digest:
                os.utime(self.path(digest))  # recently used: kept by `_prune`
            out.append(a)
        await asyncio.to_thread(self._prune, {workdir_of(a) for a in assignments})
        return out

    async def _fetch(self, stub: pb_grpc.NodeServiceStub, node_id: str, experiment_id: str, digest: str) -> None:
        t0 = time.monotonic()
        ensure_run_dir(str(self.root))
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", suffix=".tar.gz", dir=self.root)
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                req = pb.FetchWorkdirRequest(node_id=node_id, experiment_id=experiment_id, digest=digest)
                async for piece in stub.FetchWorkdir(req, timeout=FETCH_TIMEOUT_S):
                    size += len(piece.data)
                    await asyncio.to_thread(f.write, piece.data)
            await asyncio.to_thread(unpack, tmp, digest, self.root)
        finally:
            os.unlink(tmp)
        log.info("fetched workdir %s for %s (%.1f KiB) in %.2f s", digest[:19], experiment_id, size / 1024,
                 time.monotonic() - t0)

    def _prune(self, wanted: set[str]) -> None:
        if not self.root.is_dir():
            return
        keep = {d.removeprefix("sha256:") for d in wanted}
        dirs = sorted((p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                      key=lambda p: p.stat().st_mtime, reverse=True)
        for p in [p for p in dirs if p.name not in keep][KEEP:]:
            shutil.rmtree(p, ignore_errors=True)


def _reason(e: Exception) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
    return str(e)


async def _report_failed(stub: pb_grpc.NodeServiceStub, node_id: str, a: pb.Assignment, message: str) -> None:
    try:
        await stub.ReportRole(pb.ReportRoleRequest(node_id=node_id, experiment_id=a.experiment_id, role=a.role,
                                                   index=a.index, state=pb.ROLE_STATE_FAILED, message=message),
                              timeout=5.0)
    except grpc.RpcError:
        pass
