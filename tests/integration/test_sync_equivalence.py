"""Sync (BSP) mode through the real training loop equals single-process training on the global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gossamer.core.experiment import Experiment
from gossamer.engine.rank import RankContext
from gossamer.node.ports import reserve_port
from gossamer.training.shards.ps_trainer import ParameterServerTrainer
from tests._fixtures import experiment, warm_context
from tests.integration._ps_harness import Shards, reference_sync, run_trainers

pytestmark = pytest.mark.timeout(180)


#: The digits experiment of these tests (overrides per test).
SYNC: dict[str, Any] = dict(name="sync", mode="sync", optimizer="sgd", lr=0.05, momentum=0.9, num_ps_shards=2,
                            total_steps=50, eval_every=0)


def _run_workers(exp: Experiment, shards: Shards, workers: int, ckpt: Path) -> None:
    run_trainers(exp, shards.endpoints, workers, str(ckpt), timeout=120)


def test_sync_two_workers_of_16_equal_single_process_batch_32(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    exp = experiment(SYNC, batch_size=16)
    shards = Shards(exp)
    try:
        _run_workers(exp, shards, workers=2, ckpt=tmp_path)
        got = shards.flat()
    finally:
        shards.close()
    want = reference_sync(exp, global_batch=32)
    assert (got - want).abs().max().item() <= 1e-5


def test_sync_global_batch_gives_same_parameters_for_1_2_3_workers(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    exp = experiment(SYNC, global_batch_size=48, total_steps=30)
    results = []
    for workers in (1, 2, 3):
        shards = Shards(exp)
        try:
            _run_workers(exp, shards, workers=workers, ckpt=tmp_path)
            results.append(shards.flat())
        finally:
            shards.close()
    want = reference_sync(exp, global_batch=48)
    for got in results:
        assert (got - want).abs().max().item() <= 1e-5


def test_sync_adamw_with_an_llm_recipes_betas_equals_one_process_for_1_and_2_workers(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    exp = experiment(SYNC, optimizer="torch.optim.AdamW", momentum=0.0, lr=3e-3, weight_decay=0.01,
                     optimizer_args={"betas": [0.9, 0.95], "eps": 1e-8}, global_batch_size=32, total_steps=40)
    want = reference_sync(exp, global_batch=32)
    for workers in (1, 2):
        shards = Shards(exp)
        try:
            _run_workers(exp, shards, workers=workers, ckpt=tmp_path)
            got = shards.flat()
        finally:
            shards.close()
        assert (got - want).abs().max().item() <= 1e-5, workers


def _rank_main(rank: int, world: int, port: int, exp_json: str, endpoints: dict[int, str], ckpt: str,
               backend: str = "gloo") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = RankContext(experiment_id="e", experiment=Experiment.from_json(exp_json), node_id="node0",
                          worker_index=0, num_workers=1, endpoints=endpoints, checkpoint_dir=ckpt,
                          local_rank=rank, local_world=world, device=device)
        ParameterServerTrainer(ctx).run()
    finally:
        dist.destroy_process_group()


def test_two_local_ranks_allreduce_inside_node_and_exchange_own_slices(tmp_path: Path) -> None:
    """One worker node with 2 gloo ranks; small chunks so each rank owns different chunks on both shards."""
    _two_ranks(tmp_path, "gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group")
def test_two_local_ranks_on_nccl_equal_single_process(tmp_path: Path) -> None:
    """The same node layout on GPUs: NCCL all-reduce inside the node, CPU ZMQ to the shards."""
    _two_ranks(tmp_path, "nccl", atol=1e-4)  # GPU kernels sum in another order than the CPU loop


@pytest.mark.parametrize(("parallelism", "world", "schedule"),
                         [("fsdp", 2, "gpipe"), ("fsdp", 3, "gpipe"), ("pipeline", 2, "gpipe"), ("pipeline", 3, "1f1b")])
def test_fsdp_and_pipeline_nodes_equal_single_process(tmp_path: Path, parallelism: str, world: int,
                                                      schedule: str) -> None:
    """Each rank exchanges only its own rows or stage, and the step is still exactly the global-batch step."""
    _two_ranks(tmp_path, "gloo", parallelism=parallelism, world=world, schedule=schedule)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group")
@pytest.mark.parametrize("parallelism", ["fsdp", "pipeline"])
def test_fsdp_and_pipeline_on_nccl_equal_single_process(tmp_path: Path, parallelism: str) -> None:
    _two_ranks(tmp_path, "nccl", atol=1e-4, parallelism=parallelism)


def _two_ranks(tmp_path: Path, backend: str, atol: float = 1e-5, parallelism: str = "ddp", world: int = 2,
               schedule: str = "gpipe") -> None:
    exp = experiment(SYNC, batch_size=32, total_steps=20, chunk_numel=2048, parallelism=parallelism, pipeline_schedule=schedule)
    shards = Shards(exp)
    hold = reserve_port()  # bound until the ranks are done: nobody else may take the port meanwhile
    try:
        port = hold.getsockname()[1]
        ctx = warm_context()
        procs = [ctx.Process(target=_rank_main,
                             args=(r, world, port, exp.to_json(), shards.endpoints, str(tmp_path), backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0] * world
        stats = [s.stats() for s in shards.servers]
        got = shards.flat()
    finally:
        hold.close()
        for p in procs:
            if p.is_alive():
                p.kill()
        shards.close()
    if parallelism == "ddp":
        assert len(shards.plan.chunks_of_rank(0, 2)) > 0 and len(shards.plan.chunks_of_rank(1, 2)) > 0
    assert all(st["version"] == 20 for st in stats)
    want = reference_sync(exp, global_batch=32)
    assert (got - want).abs().max().item() <= atol
