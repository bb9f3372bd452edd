"""A worker's failure and the lead's Complete interleaved on a real coordinator (SQLite store): its counts are missing either way."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.core import Coordinator
from gossamer.v1 import coordinator_pb2 as pb
from tests._fixtures import experiment

PS, WORKER = pb.ROLE_PARAMETER_SERVER, pb.ROLE_WORKER


async def _running(tmp_path: Path) -> tuple[Coordinator, str, dict[int, str]]:
    """A sync run of 1 shard and 3 workers, running; worker index -> node id."""
    c = Coordinator(CoordinatorConfig(state_dir=str(tmp_path), check_imports=False, final_report_timeout_s=60.0))
    for name in ("ps", "w0", "w1", "w2"):
        await c.join(pb.JoinRequest(name=name, address="127.0.0.1"))
    exp_id = await c.submit(experiment(mode="sync", num_ps_shards=1, ps_backup=False, min_workers=3,
                                       max_workers=3).to_json())
    roles = c.exps[exp_id].roles
    ps = next(r for r in roles if r.role == PS)
    await c.report_role(pb.ReportRoleRequest(node_id=ps.node_id, experiment_id=exp_id, role=PS, index=0,
                                             state=pb.ROLE_STATE_SERVING, endpoint="tcp://127.0.0.1:1"))
    assert c.exps[exp_id].state == pb.EXPERIMENT_STATE_RUNNING
    return c, exp_id, {r.index: r.node_id for r in roles if r.role == WORKER}


@pytest.mark.parametrize("failure_first", [True, False])
def test_a_worker_failing_while_the_lead_completes_is_counted_missing(tmp_path: Path, failure_first: bool) -> None:
    async def go() -> None:
        c, exp_id, workers = await _running(tmp_path)
        fail = c.report_role(pb.ReportRoleRequest(node_id=workers[2], experiment_id=exp_id, role=WORKER, index=2,
                                                  state=pb.ROLE_STATE_FAILED, message="exited with code -9"))
        complete = c.complete(pb.CompleteExperimentRequest(experiment_id=exp_id, node_id=workers[0],
                                                           final_metrics={"steps": 40.0}))
        # Each runs to its first await (a store write) before the other starts: the pair C8
        # saw the failure's removal, then the Complete, then the failure's bookkeeping.
        await asyncio.gather(*((fail, complete) if failure_first else (complete, fail)))
        exp = c.exps[exp_id]
        await c.report_role(pb.ReportRoleRequest(node_id=workers[1], experiment_id=exp_id, role=WORKER, index=1,
                                                 state=pb.ROLE_STATE_DONE))
        assert exp.state == pb.EXPERIMENT_STATE_COMPLETED, exp.message
        assert exp.final_metrics.get("final_reports_missing") == 1.0, (exp.final_metrics, exp.message)
        assert "final counts of 1 worker(s) missing" in exp.message
        c.store.close()

    asyncio.run(go())
