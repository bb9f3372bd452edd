"""`GetRoleLog`: a role's log and last traceback, asked of the node agents that ran the experiment's roles."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from gossamer.checkpoint.fetch import FetchError, Source, ask
from gossamer.coordinator.records import NodeRec
from gossamer.coordinator.state import CoordinatorState
from gossamer.core.errors import NotFoundError, UnavailableError
from gossamer.core.role_log_names import LOG_TAIL, MAX_LISTED, Stem, parse_stem
from gossamer.security.sender_tokens import log_token
from gossamer.v1 import coordinator_pb2 as pb

__all__ = ["RoleLogReads", "get_role_log"]

log = logging.getLogger(__name__)

#: How long one node may take to answer.
NODE_TIMEOUT_S = 5.0
#: Nodes asked at once: a large cluster is asked in waves, not all in one burst of threads.
PARALLEL = 16
#: Role-log reads the coordinator serves at once; each may ask every live node and holds threads
#: of the pool the rest of the coordinator uses too. A read over this is refused at once.
MAX_READS = 4


class RoleLogReads:
    """The role-log reads in progress on one coordinator: at most `MAX_READS`, the next refused (UNAVAILABLE)."""

    def __init__(self, limit: int = MAX_READS) -> None:
        self.limit = limit
        self.active = 0
        self.refused = 0

    async def read(self, state: CoordinatorState, req: pb.GetRoleLogRequest) -> pb.RoleLog:
        if self.active >= self.limit:
            self.refused += 1
            raise UnavailableError(f"{self.active} role-log reads are in progress on this coordinator "
                                   f"(at most {self.limit} at once); ask again in a moment")
        self.active += 1
        try:
            return await get_role_log(state, req)
        finally:
            self.active -= 1


@dataclass(frozen=True)
class _Found:
    node: NodeRec
    stem: str
    role: Stem
    mtime: float
    traceback_mtime: float
    size: int


def _label(f: _Found) -> str:
    if f.role.worker:
        what = f"worker/{f.role.index} rank {f.role.local_rank}"
    else:
        what = f"ps/{f.role.index}" + (" (backup)" if f.role.replica else "")
    extra = ", traceback" if f.traceback_mtime else ""
    return f"{what} on {f.node.name} ({f.size} bytes{extra})"


def _source(node: NodeRec, experiment: str) -> Source:
    return Source(node.checkpoint_endpoint, log_token(node.checkpoint_secret, experiment), node.checkpoint_key)


async def _ask(node: NodeRec, experiment: str, gate: asyncio.Semaphore, **fields: Any) -> tuple[dict[str, Any], bytes]:
    """One `logs` request to `node`'s agent, off the event loop (its file server speaks ZMQ)."""
    async with gate:
        return await asyncio.to_thread(ask, _source(node, experiment), experiment, "logs", NODE_TIMEOUT_S, **fields)


def _candidates(state: CoordinatorState, experiment: str, bound: set[str], pinned: str) -> list[NodeRec]:
    """Live nodes with a file server, those bound to the experiment's roles first; only `pinned` if named."""
    nodes = [n for n in state.nodes.values() if n.alive and n.checkpoint_endpoint and n.checkpoint_secret]
    if pinned:
        nodes = [n for n in nodes if n.id == pinned]
    return sorted(nodes, key=lambda n: (n.id not in bound, n.joined_unix))


def _wanted(req: pb.GetRoleLogRequest, role: Stem) -> bool:
    if req.role == pb.ROLE_UNSPECIFIED:
        return True
    if role.worker != (req.role == pb.ROLE_WORKER) or role.index != req.index:
        return False
    return not req.HasField("local_rank") or role.local_rank == req.local_rank


def _choose(req: pb.GetRoleLogRequest, found: list[_Found]) -> _Found | None:
    """The log asked for: the newest of the role (its newest traceback's rank, unless a rank is named);
    with no role named, the role whose traceback is newest, else the newest log."""
    matches = [f for f in found if _wanted(req, f.role)]
    if not matches:
        return None
    if req.role == pb.ROLE_UNSPECIFIED:
        return max(matches, key=lambda f: (f.traceback_mtime, f.mtime))
    newest = max(matches, key=lambda f: f.mtime)
    if req.HasField("local_rank") or not newest.role.worker:
        return newest
    # Every local rank of that run of the worker (same node): the one that failed tells why.
    ranks = [f for f in matches if f.node.id == newest.node.id]
    failed = [f for f in ranks if f.traceback_mtime]
    if failed:
        return max(failed, key=lambda f: f.traceback_mtime)
    return min(ranks, key=lambda f: f.role.local_rank)


async def get_role_log(state: CoordinatorState, req: pb.GetRoleLogRequest) -> pb.RoleLog:
    """Ask the nodes which role logs of the experiment they hold, then the chosen one for its log and traceback.

    The nodes the experiment's roles are bound to are asked first; the other live nodes (where a
    failed or replaced role ran) only when those hold no log of the role. At most `LOG_TAIL` bytes
    come back.

    Raises:
        NotFoundError: unknown experiment, or no live node holds a log of the role.
    """
    exp = state.exps.get(req.experiment_id)
    if exp is None:
        raise NotFoundError(f"experiment {req.experiment_id!r} not found")
    bound = {r.node_id for r in exp.roles}
    gate = asyncio.Semaphore(PARALLEL)
    found: list[_Found] = []
    notes: list[str] = []
    nodes = _candidates(state, exp.id, bound, req.node_id)
    first = [n for n in nodes if n.id in bound]
    for wave in (first, [n for n in nodes if n.id not in bound]):
        answers = await asyncio.gather(*(_ask(n, exp.id, gate) for n in wave), return_exceptions=True)
        for node, answer in zip(wave, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, (FetchError, OSError)):
                    raise answer
                notes.append(f"{node.name}: {answer}")
                continue
            found.extend(_listed(node, answer[0]))
        if req.role != pb.ROLE_UNSPECIFIED and _choose(req, found) is not None:
            break  # a named role's log is on the nodes bound to it; the newest traceback may be anywhere
    chosen = _choose(req, found)
    if chosen is None:
        what = "any role" if req.role == pb.ROLE_UNSPECIFIED else _asked(req)
        why = f" ({'; '.join(notes)})" if notes else ""
        raise NotFoundError(f"no live node holds a log of {what} of {exp.id}{why}")
    try:
        meta, blob = await _ask(chosen.node, exp.id, gate, stem=chosen.stem, offset=int(req.offset),
                                max=min(int(req.max_bytes) or LOG_TAIL, LOG_TAIL))
    except FetchError as e:
        raise NotFoundError(f"{chosen.node.name} did not give the log of {_label(chosen)}: {e}") from None
    found.sort(key=lambda f: -max(f.mtime, f.traceback_mtime))
    start, offset = int(meta.get("start", 0)), int(req.offset)
    # Left out before `start`: from the offset asked for, or (the tail; a log rolled over since) from its beginning.
    skipped = start - offset if 0 < offset <= start else start
    return pb.RoleLog(
        node_id=chosen.node.id, node_name=chosen.node.name,
        role=pb.ROLE_WORKER if chosen.role.worker else pb.ROLE_PARAMETER_SERVER, index=chosen.role.index,
        local_rank=chosen.role.local_rank, replica=chosen.role.replica, text=blob[:LOG_TAIL], start=start,
        end=start + len(blob[:LOG_TAIL]), skipped=skipped,
        traceback=str(meta.get("traceback", "")), traceback_unix=float(meta.get("traceback_mtime", 0.0)),
        modified_unix=float(meta.get("mtime", 0.0)), available=[_label(f) for f in found[:MAX_LISTED]],
        note="; ".join(notes),
    )


def _asked(req: pb.GetRoleLogRequest) -> str:
    worker = req.role == pb.ROLE_WORKER
    rank = f" rank {req.local_rank}" if req.HasField("local_rank") else ""
    return f"{'worker' if worker else 'ps'}/{req.index}{rank}"


def _listed(node: NodeRec, meta: dict[str, Any]) -> list[_Found]:
    """The role logs one node's answer lists (malformed rows left out)."""
    out = []
    rows = meta.get("logs")
    for row in rows[:MAX_LISTED] if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("stem"), str):
            continue
        role = parse_stem(row["stem"])
        if role is None or role.name != row["stem"]:
            continue
        try:
            out.append(_Found(node, row["stem"], role, float(row.get("mtime", 0.0)),
                              float(row.get("traceback_mtime", 0.0)), int(row.get("size", 0))))
        except (TypeError, ValueError):
            continue
    return out
