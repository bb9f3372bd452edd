"""Failover policy: when a node counts as lost, and what replaces a lost role (pure logic, time passed in)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gossamer.coordinator.records import NodeRec, RoleRec
from gossamer.core.experiment import CODE_FIELDS
from gossamer.core.protocol import RESTORE_SEEDING
from gossamer.v1 import coordinator_pb2 as pb


def lease_verdict(node: NodeRec, *, now: float, lease_timeout_s: float, heartbeat_interval_s: float,
                  blind_since: Callable[[float], float] = lambda t: 0.0) -> tuple[str, float] | None:
    """(why, seconds silent) if `node` is lost at `now`, else None.

    `blind_since(t)`: how long after `t` the coordinator itself could not observe heartbeats
    (`BlindTime.since`); that time is not the node's silence. It only makes a loss later, so
    the node's own fencing (`shard_lease_s`) still stops an isolated primary first.

    Lost: its lease expired, or its assignment stream dropped and neither a heartbeat nor a
    reconnection came for two heartbeat intervals.
    A process that dies (kill -9, OOM, crash) closes its TCP connections at once, so its
    stream ends; a live node reconnects it or heartbeats within one interval. Two quiet
    intervals after the drop are enough evidence; a machine that vanishes without closing
    anything is caught by the lease.
    """
    if not node.alive:
        return None
    silent = now - node.last_seen
    if silent <= lease_timeout_s and not node.stream_lost_at:
        return None  # blind time only shortens a silence: nothing to weigh (every live node, every sweep)
    blind = blind_since(node.last_seen)
    if silent - blind > lease_timeout_s:
        held = f"; the coordinator itself was not scheduled for {blind:.1f}s of it" if blind >= 0.05 else ""
        return f"lease expired ({silent:.1f}s without heartbeat{held})", silent
    fast = 2.0 * heartbeat_interval_s
    # Quiet since the later of the drop and the last heartbeat: a heartbeat the node sent just
    # before it died may be handled after the drop on a busy loop; it postpones, never cancels.
    quiet_from = max(node.stream_lost_at, node.last_seen)
    if node.stream_lost_at and now - quiet_from - blind_since(quiet_from) > fast:
        return f"connection closed and no heartbeat for {silent:.1f}s", silent
    return None


def lease_suspects(nodes: Iterable[NodeRec], *, now: float, lease_timeout_s: float,
                   is_open: Callable[[str], bool]) -> tuple[int, list[NodeRec]]:
    """The live nodes with an open assignment stream (a count), and the live nodes `lease_verdict` may remove.

    One pass, every lease sweep (twice a second): at 10,000 nodes a `lease_verdict` call per
    node took 9 % of the coordinator's CPU. Only a node silent past `lease_timeout_s` or with its
    stream dropped can get a verdict (a starved coordinator's longer lease only shortens the list).
    """
    connected, suspects = 0, []
    for n in nodes:
        if n.alive:
            connected += is_open(n.id)
            if n.stream_lost_at or now - n.last_seen > lease_timeout_s:
                suspects.append(n)
    return connected, suspects


def replacement_order(lost: Sequence[RoleRec]) -> list[RoleRec]:
    """The order lost roles are re-planned in: primaries first, since a lost primary may
    promote a backup that was lost with it."""
    return sorted(lost, key=lambda r: (r.role, r.replica))


@dataclass(frozen=True, kw_only=True)
class DropWorker:
    """A worker is gone: the others go on (the next free node joins as a new worker)."""


@dataclass(frozen=True, kw_only=True)
class ReplaceBackup:
    """A shard's backup is gone: the primary serves unreplicated until a new backup syncs."""

    #: The replicas of the shard left (the primary): no longer replicated.
    unreplicated: tuple[RoleRec, ...]


@dataclass(frozen=True, kw_only=True)
class PromoteBackup:
    """A shard's primary is gone and its synced backup serves: it becomes the primary."""

    backup: RoleRec


@dataclass(frozen=True, kw_only=True)
class RestoreShard:
    """Every usable replica of a shard is gone: a new primary loads the newest good checkpoint."""

    #: Replicas of the shard left that cannot serve (a backup not synced): removed.
    stale: tuple[RoleRec, ...]


Recovery = DropWorker | ReplaceBackup | PromoteBackup | RestoreShard


def recovery_for(lost: RoleRec, roles: Sequence[RoleRec]) -> Recovery:
    """What replaces role `lost`, given the experiment's remaining `roles` (without `lost`)."""
    if lost.role == pb.ROLE_WORKER:
        return DropWorker()
    replicas = tuple(r for r in roles if r.role == pb.ROLE_PARAMETER_SERVER and r.index == lost.index)
    if lost.replica == 1:
        return ReplaceBackup(unreplicated=replicas)
    backup = next((r for r in replicas if r.replica == 1), None)
    if backup is not None and lost.replicated and backup.state == pb.ROLE_STATE_SERVING and backup.endpoint:
        return PromoteBackup(backup=backup)
    return RestoreShard(stale=replicas)


def roll_back_together(roles: Sequence[RoleRec], index: int, *, barrier: bool) -> list[int]:
    """The shards that restore from the checkpoint when shard `index` does.

    With a barrier every shard must stand at the same version, so all of them roll back
    together; otherwise only shard `index`.
    """
    if not barrier:
        return [index]
    return sorted({index} | {r.index for r in roles if r.role == pb.ROLE_PARAMETER_SERVER})


def restore_outcome(roles: Sequence[RoleRec], shard: RoleRec, *, index: int, version: int, source: str,
                    last: int, counted: int = 0, unknown: str = "") -> tuple[str, str, int] | None:
    """The event a shard's report of restoring calls for: (kind, message, versions lost), or None.

    `source`: where the shard said it restored from (RESTORE_SEEDING: it waits for the workers'
    copies); `last`: the highest version the coordinator heard of before the loss; `counted`: the
    versions lost the shard counted, and `unknown` why that is not the exact count ("": it is,
    for a rebuild from the workers' copies).
    """
    if source == RESTORE_SEEDING:
        if any(r.role == pb.ROLE_WORKER for r in roles):
            return "restore", f"shard {index}: no checkpoint found; rebuilding it from the freshest worker's copy", 0
        # No worker left to hold a copy, so none can come (a new worker holds the initial values).
        source = "(none: no checkpoint, and no worker left to hold a copy)"
    elif not (source or (shard.restore_epoch and version == 0 and not shard.version)):
        return None
    head = f"shard {index} restored from {source or 'its initial values'} at version {version}"
    if source.endswith("'s copy") and not unknown:
        return ("restored", f"{head}; {counted} version(s) lost, counted exactly from every worker's copy (each says "
                "which of its updates were acknowledged)", counted)
    # The shard's metric points come once a second: the last version heard of is only a lower bound.
    lost = max(counted, last - version)
    why = unknown or "each worker's updates since are counted as it pushes again"
    return ("restored", f"{head}; at least {lost} version(s) lost (last reported version {last}); the exact count is "
            f"not known yet: {why} (lost-updates events follow)", lost)


def gives_up(failures: int, max_workers: int) -> bool:
    """Whether `failures` crashed role processes end the experiment (a budget against crash loops)."""
    return failures > max(10, 3 * max_workers)


#: Workers failed by the experiment's own code (one Experiment field) before the experiment fails: the
#: first may have met something passing (a file being written, a full disk), the second ran the same
#: code on the same data again. Restarting more only repeats the traceback (49 restarts, seen).
USER_CODE_FAILURES = 2


def failure_ends(user_failures: dict[str, int], failures: int, max_workers: int, req: pb.ReportRoleRequest) -> str:
    """Why the experiment ends with the role failure `req` (its `failures`-th), or "" when it goes on.

    A worker failed by the experiment's own code (`req.user_field` one of CODE_FIELDS; any other
    is not counted) is counted in `user_failures`, per field.
    """
    if req.role == pb.ROLE_WORKER and req.user_field in CODE_FIELDS:
        n = user_failures[req.user_field] = user_failures.get(req.user_field, 0) + 1
        if n >= USER_CODE_FAILURES:
            return f"the experiment's own `{req.user_field}` failed {n} workers: not retried"
    return f"{failures} role failures: giving up" if gives_up(failures, max_workers) else ""


#: How a worker's failure names the shards that did not answer it (ShardClient's UnavailableError).
_UNANSWERED = re.compile(r"shards \[([0-9, ]+)\] did not answer")


class ShardSuspicion:
    """Which shards their workers time out on (pure logic, time passed in).

    A shard whose process lives but does not answer (stopped, wedged) keeps its node's lease:
    only its workers see it, each failing with "shards [i] did not answer". When two distinct
    workers (the only one, in a run of one worker) have failed so on shard i within `window_s`,
    shard i is suspected and its primary is failed over, instead of the workers being replaced
    over and over against a shard that never answers.
    """

    def __init__(self, window_s: float = 300.0) -> None:
        self.window_s = window_s
        self._seen: dict[tuple[str, int], dict[str, float]] = {}  # (experiment, shard) -> worker -> time

    def timed_out(self, experiment: str, worker: str, message: str, now: float, *, workers: int) -> list[int]:
        """Note `worker`'s failure `message`; the shards suspected now (`workers`: how many the run has)."""
        found = _UNANSWERED.search(message)
        if found is None:
            return []
        suspected = []
        for index in sorted({int(x) for x in found.group(1).split(",") if x.strip()}):
            seen = self._seen.setdefault((experiment, index), {})
            seen[worker] = now
            for w in [w for w, t in seen.items() if now - t > self.window_s]:
                del seen[w]
            if len(seen) >= min(2, max(1, workers)):
                suspected.append(index)
                del self._seen[(experiment, index)]
        return suspected

    def forget(self, experiment: str) -> None:
        """`experiment` ended."""
        self._seen = {k: v for k, v in self._seen.items() if k[0] != experiment}
