"""Completion waits for every worker's final counters: whom it still waits for, and whose counts it gave up on."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gossamer.coordinator.records import ExpRec
from gossamer.errors import ConfigError
from gossamer.v1 import coordinator_pb2 as pb

__all__ = ["Completed", "begin", "settle"]


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

    A waited-for worker no longer among the roles (it failed or its node was lost) will not
    report: its last counts are missing. Past `timeout_s` the ones still silent are missing too.
    The missing are counted in the final metrics (`final_reports_missing`). `names`: node id -> name.
    """
    workers = {f"{r.node_id}/{r.index}": r for r in exp.roles_of(pb.ROLE_WORKER)}
    pending: list[str] = []
    missing: list[str] = []
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
    if not missing:
        return Completed(message, "")
    exp.final_metrics["final_reports_missing"] = float(len(missing))
    return Completed(f"{message}; final counts of {len(missing)} worker(s) missing: samples, updates and bytes "
                     "undercount", "final counts missing (samples, updates and bytes count less than were "
                     "trained): " + "; ".join(missing))
