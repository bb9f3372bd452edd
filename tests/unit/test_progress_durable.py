"""A run's step count is shown once it is stored: a coordinator killed after a status said N steps restarts at N."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gossamer.coordinator.config import CoordinatorConfig
from gossamer.coordinator.core import Coordinator
from gossamer.v1 import coordinator_pb2 as pb
from tests._fixtures import experiment


def _coordinator(tmp_path: Path) -> Coordinator:
    return Coordinator(CoordinatorConfig(state_dir=str(tmp_path), check_imports=False))


def test_steps_are_shown_only_once_written_and_a_restart_keeps_what_was_shown(tmp_path: Path) -> None:
    async def go() -> tuple[str, list[int]]:
        c = _coordinator(tmp_path)
        for i in range(2):
            await c.join(pb.JoinRequest(name=f"n{i}", address="127.0.0.1"))
        exp_id = await c.submit(experiment(mode="async", num_ps_shards=1, min_workers=1, max_workers=1).to_json())
        gate = asyncio.Event()
        write: Callable[..., Awaitable[Any]] = c.store.write

        async def held_write(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()  # the disk is slow: the report's writes wait here
            return await write(*args, **kwargs)

        c.store.write = held_write  # type: ignore[method-assign]
        point = pb.MetricPoint(time_unix=1.0, step=200, source="w/0", values={"loss": 1.0})
        report = asyncio.create_task(c.report_metrics(pb.ReportMetricsRequest(experiment_id=exp_id, points=[point])))
        seen = []
        for _ in range(20):  # the report runs up to its first write, then waits on the disk
            await asyncio.sleep(0)
            seen.append(c.exps[exp_id].steps)
        gate.set()
        await report
        seen.append(c.exps[exp_id].steps)
        c.store.close()
        return exp_id, seen

    exp_id, seen = asyncio.run(go())
    assert seen[:-1] == [0] * 20 and seen[-1] == 200, seen  # not shown while unwritten; shown once written

    async def restarted() -> int:
        c = _coordinator(tmp_path)  # the same state directory, as after a kill -9
        steps = c.exps[exp_id].steps
        c.store.close()
        return steps

    assert asyncio.run(restarted()) == 200


def test_concurrent_reports_never_store_fewer_steps_than_shown(tmp_path: Path) -> None:
    """Two workers' reports (and a checkpoint's save) queued together: the last write is not the highest step.

    The HA failover test saw it: a status said 300 steps, the leader was killed, the new leader
    read 244 back, because a report of a lower step (or a save of the record as it stood) was
    committed after the one of 300.
    """
    async def go() -> tuple[str, int]:
        c = _coordinator(tmp_path)
        for i in range(3):
            await c.join(pb.JoinRequest(name=f"n{i}", address="127.0.0.1"))
        exp_id = await c.submit(experiment(mode="async", num_ps_shards=1, min_workers=2, max_workers=2).to_json())

        def report(source: str, step: int) -> Awaitable[bool]:
            point = pb.MetricPoint(time_unix=1.0, step=step, source=source, values={"loss": 1.0})
            return c.report_metrics(pb.ReportMetricsRequest(experiment_id=exp_id, points=[point]))

        await report("w/1", 244)
        first = asyncio.create_task(report("w/0", 300))
        await asyncio.sleep(0)  # w/0's report is queued at the disk with 300
        later = asyncio.create_task(report("w/1", 250))
        checkpoint = asyncio.create_task(c.register_checkpoint(pb.CheckpointInfo(
            experiment_id=exp_id, step=250, path=str(tmp_path / "ckpt"), kind="shard", node_id="nobody")))
        await asyncio.gather(first, later, checkpoint)
        shown = c.exps[exp_id].steps
        c.store.close()
        return exp_id, shown

    exp_id, shown = asyncio.run(go())
    assert shown == 300

    async def restarted() -> int:
        c = _coordinator(tmp_path)
        steps = c.exps[exp_id].steps
        c.store.close()
        return steps

    assert asyncio.run(restarted()) == shown
