"""Completion waits for every worker's final counters: whom it still waits for, and whose counts it gave up on."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossamer.coordinator.records import ExpRec, RoleRec
from gossamer.core.errors import ConfigError
from gossamer.v1 import coordinator_pb2 as pb

__all__ = ["NAMED", "Completed", "begin", "ended", "settle"]

#: Workers that ended unreported are named up to this many (churn over a long run is counted, not listed).
NAMED = 64


def ended(exp: ExpRec, role: RoleRec) -> None:
    """A role of `exp` ended (failed or lost) before the lead's Complete: a worker leaves counts missing.

    Its samples, updates and bytes since its last report were trained but never counted, so the
    completion names it whether it ended mid-run or after its last step but before its report.
    After Complete, `settle` accounts for the workers it awaits (and the lead had flushed).
    """
    if role.role != pb.ROLE_WORKER or role.state == pb.ROLE_STATE_DONE or exp.completing_unix:
        return
    exp.unreported += 1
    if len(exp.ended_unreported) < NAMED:
        exp.ended_unreported.append(f"{role.node_id}/{role.index}")


def begin(exp: ExpRec, req: pb.CompleteExperimentRequest, *, now: float) -> bool:
    """Take the lead's Complete: its final metrics and checkpoint, and whose final reports to wait for.

    False when a Complete was taken already (a retry, or a second lead's): the first stands.
    The run waits for every worker but the lead's, which flushed its counters before it sent
    Complete; a worker reports ROLE_STATE_DONE right after its final counters.
    """
    steps = req.final_metrics.get("steps", float(exp.steps))
    if not (math.isfinite(steps) and 0 <= steps < 2**63):  # else every later status() of it fails
        raise ConfigError("final_metrics", f"'steps' must be a step count, got {steps!r}")
    if exp.completing_unix:
        return False
    exp.final_metrics, exp.checkpoint, exp.steps = dict(req.final_metrics), req.checkpoint, int(steps)
    exp.completing_unix = now
    exp.awaiting_final = [f"{r.node_id}/{r.index}" for r in exp.roles_of(pb.ROLE_WORKER)
                          if r.node_id != req.node_id and r.state != pb.ROLE_STATE_DONE]
    return True


@dataclass(frozen=True)
class Completed:
    """A completion no longer waiting: the run's message, and the warning event to add ("": none)."""

    message: str
    warning: str


def settle(exp: ExpRec, *, now: float, timeout_s: float, names: dict[str, str]) -> Completed | None:
    """The completion of `exp` at time `now`, or None while a worker's final report is still awaited.

    A worker that ended before Complete (`ended`), or a waited-for one no longer among the roles
    (it failed or its node was lost), will not report: its last counts are missing. Past
    `timeout_s` the ones still silent are missing too.
    The missing are counted in the final metrics (`final_reports_missing`). `names`: node id -> name.
    """
    workers = {f"{r.node_id}/{r.index}": r for r in exp.roles_of(pb.ROLE_WORKER)}
    pending: list[str] = []
    missing = [f"worker {index} on {names.get(node_id, node_id)}: it ended (failed or lost) before its final report"
               for node_id, _, index in (key.rpartition("/") for key in exp.ended_unreported)]
    overdue = now - exp.completing_unix >= timeout_s
    for key in exp.awaiting_final:
        node_id, _, index = key.rpartition("/")
        who = f"worker {index} on {names.get(node_id, node_id)}"
        role = workers.get(key)
        if role is None:
            missing.append(f"{who}: it ended (failed or lost) before its final report")
        elif role.state != pb.ROLE_STATE_DONE and overdue:
            missing.append(f"{who}: no final report within {timeout_s:g} s (final_report_timeout_s)")
        elif role.state != pb.ROLE_STATE_DONE:
            pending.append(key)
    if pending:
        return None
    acc = exp.final_metrics.get("eval_accuracy")
    message = f"completed {exp.steps} steps" + (f", eval accuracy {acc:.4f}" if acc is not None else "")
    count = len(missing) + exp.unreported - len(exp.ended_unreported)  # the ones past NAMED are counted only
    if not count:
        return Completed(message, "")
    exp.final_metrics["final_reports_missing"] = float(count)
    more = f"; and {count - len(missing)} more" if count > len(missing) else ""
    return Completed(f"{message}; final counts of {count} worker(s) missing: samples, updates and bytes "
                     "undercount", "final counts missing (samples, updates and bytes count less than were "
                     "trained): " + "; ".join(missing) + more)
