"""Completion waits for the workers' final reports: pending, done, ended before it, silent past the timeout."""

from __future__ import annotations

import pytest

from gossamer.coordinator import final_reports
from gossamer.coordinator.records import ExpRec, RoleRec
from gossamer.core.errors import ConfigError
from gossamer.v1 import coordinator_pb2 as pb

NAMES = {"n0": "w0", "n1": "w1", "n2": "w2"}


def _exp() -> ExpRec:
    exp = ExpRec(id="e", seq=1, name="e", spec_json="{}", state=pb.EXPERIMENT_STATE_RUNNING, steps=7)
    exp.roles = [RoleRec("ps", pb.ROLE_PARAMETER_SERVER, 0, pb.ROLE_STATE_SERVING),
                 *(RoleRec(f"n{i}", pb.ROLE_WORKER, i, pb.ROLE_STATE_SERVING) for i in range(3))]
    return exp


def _complete(exp: ExpRec, now: float = 100.0) -> bool:
    req = pb.CompleteExperimentRequest(experiment_id="e", node_id="n0", final_metrics={"steps": 10.0,
                                                                                       "eval_accuracy": 0.5})
    return final_reports.begin(exp, req, now=now)


def test_the_run_completes_once_every_other_worker_reported_done() -> None:
    exp = _exp()
    exp.roles[3].state = pb.ROLE_STATE_DONE  # worker 2 finished before the lead's Complete
    assert _complete(exp) and exp.awaiting_final == ["n1/1"] and exp.steps == 10
    assert final_reports.settle(exp, now=101.0, timeout_s=30.0, names=NAMES) is None
    exp.roles[2].state = pb.ROLE_STATE_DONE
    done = final_reports.settle(exp, now=102.0, timeout_s=30.0, names=NAMES)
    assert done == final_reports.Completed("completed 10 steps, eval accuracy 0.5000", "")
    assert "final_reports_missing" not in exp.final_metrics
    assert not _complete(exp, now=103.0) and exp.completing_unix == 100.0  # a second Complete changes nothing


def test_a_worker_that_ended_or_stayed_silent_is_named_missing_and_counted() -> None:
    exp = _exp()
    _complete(exp)
    exp.roles.pop(2)  # worker 1 failed: dropped
    assert final_reports.settle(exp, now=129.0, timeout_s=30.0, names=NAMES) is None  # worker 2 still awaited
    done = final_reports.settle(exp, now=130.0, timeout_s=30.0, names=NAMES)
    assert done is not None and exp.final_metrics["final_reports_missing"] == 2.0
    assert "final counts of 2 worker(s) missing" in done.message
    assert "worker 1 on w1: it ended" in done.warning and "worker 2 on w2: no final report within 30 s" in done.warning


def test_a_complete_with_a_step_count_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="final_metrics"):
        final_reports.begin(_exp(), pb.CompleteExperimentRequest(final_metrics={"steps": float("nan")}), now=1.0)


def test_a_worker_that_ended_before_the_complete_is_missing_and_the_lead_after_it_is_not() -> None:
    exp = _exp()
    final_reports.ended(exp, exp.roles[0])  # a shard: no counts of its own to miss
    dead = exp.roles.pop(3)  # worker 2 died past its last step, before its final report (and before Complete)
    final_reports.ended(exp, dead)
    done_one = RoleRec("n9", pb.ROLE_WORKER, 9, pb.ROLE_STATE_DONE)
    final_reports.ended(exp, done_one)  # its final report came: nothing missing
    exp = ExpRec.from_json(exp.to_json())  # a coordinator restart keeps the record
    _complete(exp)
    assert exp.awaiting_final == ["n1/1"]
    exp.roles[2].state = pb.ROLE_STATE_DONE
    final_reports.ended(exp, exp.roles[1])  # the lead lost after Complete: it flushed its counts before
    done = final_reports.settle(exp, now=101.0, timeout_s=30.0, names=NAMES)
    assert done is not None and exp.final_metrics["final_reports_missing"] == 1.0
    assert "final counts of 1 worker(s) missing" in done.message
    assert done.warning.endswith("worker 2 on w2: it ended (failed or lost) before its final report"), done.warning


def test_churn_over_a_long_run_is_counted_whole_and_named_in_part() -> None:
    exp = _exp()
    for i in range(final_reports.NAMED + 36):
        final_reports.ended(exp, RoleRec(f"x{i}", pb.ROLE_WORKER, 10 + i, pb.ROLE_STATE_SERVING))
    assert len(exp.ended_unreported) == final_reports.NAMED and exp.unreported == final_reports.NAMED + 36
    for r in exp.roles[2:]:
        r.state = pb.ROLE_STATE_DONE
    _complete(exp)
    done = final_reports.settle(exp, now=101.0, timeout_s=30.0, names=NAMES)
    assert done is not None and exp.final_metrics["final_reports_missing"] == final_reports.NAMED + 36
    assert done.warning.endswith("; and 36 more") and "worker 10 on x0: it ended" in done.warning
