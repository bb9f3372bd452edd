"""Workers failed by the experiment's own code end it on the second such failure; node failures keep the crash budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.core import Coordinator
from gossamer.coordinator.records import ExpRec
from gossamer.v1 import coordinator_pb2 as pb
from tests._fixtures import experiment

PS, WORKER = pb.ROLE_PARAMETER_SERVER, pb.ROLE_WORKER


async def _running(tmp_path: Path) -> tuple[Coordinator, str]:
    c = Coordinator(CoordinatorConfig(state_dir=str(tmp_path), check_imports=False))
    for name in ("ps", "w0", "w1"):
        await c.join(pb.JoinRequest(name=name, address="127.0.0.1"))
    exp_id = await c.submit(experiment(num_ps_shards=1, ps_backup=False, min_workers=2, max_workers=2).to_json())
    ps = next(r for r in c.exps[exp_id].roles if r.role == PS)
    await c.report_role(pb.ReportRoleRequest(node_id=ps.node_id, experiment_id=exp_id, role=PS, index=0,
                                             state=pb.ROLE_STATE_SERVING, endpoint="tcp://127.0.0.1:1"))
    assert c.exps[exp_id].state == pb.EXPERIMENT_STATE_RUNNING
    return c, exp_id


async def _fail_a_worker(c: Coordinator, exp_id: str, message: str, user_field: str = "") -> None:
    worker = next(r for r in c.exps[exp_id].roles if r.role == WORKER)
    await c.report_role(pb.ReportRoleRequest(node_id=worker.node_id, experiment_id=exp_id, role=WORKER,
                                             index=worker.index, state=pb.ROLE_STATE_FAILED, message=message,
                                             user_field=user_field))


def test_the_second_worker_failed_by_the_users_loss_fails_the_experiment_naming_it(tmp_path: Path) -> None:
    async def go() -> None:
        c, exp_id = await _running(tmp_path)
        msg = "ConfigError: loss: tests.x:per_sample returned float32[32]; it must return the batch-mean loss"
        await _fail_a_worker(c, exp_id, msg, "loss")
        exp = c.exps[exp_id]
        assert exp.active and exp.user_failures == {"loss": 1}  # once: the worker is replaced
        assert ExpRec.from_json(exp.to_json()).user_failures == {"loss": 1}  # and stored
        await _fail_a_worker(c, exp_id, msg, "loss")
        assert exp.state == pb.EXPERIMENT_STATE_FAILED
        assert msg in exp.message and "the experiment's own `loss` failed 2 workers: not retried" in exp.message
        c.store.close()

    asyncio.run(go())


def test_node_failures_and_fields_that_are_no_user_code_keep_the_crash_budget(tmp_path: Path) -> None:
    async def go() -> None:
        c, exp_id = await _running(tmp_path)
        for _ in range(3):
            await _fail_a_worker(c, exp_id, "exited with code -9")
            await _fail_a_worker(c, exp_id, "ConfigError: precision: fp16 needs a CUDA device", "precision")
            await _fail_a_worker(c, exp_id, "anything", "not-a-field")
        exp = c.exps[exp_id]
        assert exp.active and exp.failures == 9 and exp.user_failures == {}, exp.message
        c.store.close()

    asyncio.run(go())
