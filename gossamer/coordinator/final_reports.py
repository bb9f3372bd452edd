"""Completion waits for every worker's final counters: whom it still waits for, and whose counts it gave up on."""

from __future__ import annotations

from dataclasses import dataclass

from gossamer.coordinator.records import ExpRec, RoleRec
from gossamer.v1 import coordinator_pb2 as pb

__all__ = ["Settled", "awaited_at_complete", "outcome", "settle"]


def _key(role: RoleRec) -> str:
    return f"{role.node_id}/{role.index}"


def awaited_at_complete(exp: ExpRec, lead_node: str) -> list[str]:
    """The workers ("node_id/index") whose final report the completion waits for.

    Every worker of the run but the lead's: the lead flushed its own counters before it
    sent Complete. A worker reports ROLE_STATE_DONE right after its final counters.
    """
    return [_key(r) for r in exp.roles_of(pb.ROLE_WORKER)
            if r.node_id != lead_node and r.state != pb.ROLE_STATE_DONE]


@dataclass(frozen=True)
class Settled:
    """Where a pending completion stands: `done` once nobody is waited for any more."""

    done: bool
    #: Workers still waited for ("node_id/index").
    pending: list[str]
    #: Workers whose final counters never came, each with why ("worker 1 on w2: it ended ...").
    missing: list[str]


def settle(exp: ExpRec, *, now: float, timeout_s: float, names: dict[str, str]) -> Settled:
    """The completion of `exp` (Complete received at `exp.completing_unix`) at time `now`.

    A waited-for worker no longer among the roles (it failed or its node was lost) will not
    report: its last counts are missing. Past `timeout_s` the ones still silent are missing too.
    `names`: node id -> node name, for the messages.
    """
    workers = {_key(r): r for r in exp.roles_of(pb.ROLE_WORKER)}
    pending: list[str] = []
    missing: list[str] = []
    for key in exp.awaiting_final:
        node_id, _, index = key.rpartition("/")
        who = f"worker {index} on {names.get(node_id, node_id)}"
        role = workers.get(key)
        if role is None:
            missing.append(f"{who}: it ended (failed or lost) before its final report")
        elif role.state != pb.ROLE_STATE_DONE:
            pending.append(key)
    overdue = now - exp.completing_unix >= timeout_s
    if pending and overdue:
        for key in pending:
            node_id, _, index = key.rpartition("/")
            missing.append(f"worker {index} on {names.get(node_id, node_id)}: "
                           f"no final report within {timeout_s:g} s (final_report_timeout_s)")
        pending = []
    return Settled(done=not pending, pending=pending, missing=missing)


def outcome(exp: ExpRec, settled: Settled) -> tuple[str, str]:
    """The completed run's message, and the warning event to add ("": none); notes the missing in its final metrics."""
    acc = exp.final_metrics.get("eval_accuracy")
    message = f"completed {exp.steps} steps" + (f", eval accuracy {acc:.4f}" if acc is not None else "")
    if not settled.missing:
        return message, ""
    exp.final_metrics["final_reports_missing"] = float(len(settled.missing))
    message += f"; final counts of {len(settled.missing)} worker(s) missing: samples, updates and bytes undercount"
    return message, ("final counts missing (samples, updates and bytes count less than were trained): "
                     + "; ".join(settled.missing))
