"""Sync with the user's loss, batches and streams still equals single-process training on the global batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gossamer.core.experiment import Experiment
from gossamer.engine import sampler
from gossamer.engine.batches import Data
from gossamer.engine.model import build
from gossamer.engine.rank import RankContext
from gossamer.engine.shard_plan import flatten_params
from gossamer.node.ports import reserve_port
from gossamer.paramserver.local import LocalShards
from gossamer.training.shards.ps_trainer import ParameterServerTrainer
from tests._fixtures import warm_context
from tests.integration import _user_regression as user
from tests.integration._ps_harness import run_trainers

pytestmark = pytest.mark.timeout(180)

U = "tests.integration._user_regression"
BASE: dict[str, Any] = dict(name="user", mode="sync", optimizer="sgd", lr=0.05, momentum=0.9, num_ps_shards=2,
                            total_steps=20, eval_every=0, model=f"{U}:mlp", dataset=f"{U}:tensor_data")


def _train(exp: Experiment, workers: int, ckpt: Path) -> torch.Tensor:
    """`workers` real trainers (threads) against real shards over loopback; the final flat parameters."""
    torch.set_num_threads(1)
    shards = LocalShards(exp)
    try:
        run_trainers(exp, shards.endpoints, workers, str(ckpt), timeout=120)
        return shards.flat()
    finally:
        shards.close()


def _reference(exp: Experiment, global_batch: int, loss: Callable[[Any, Any], torch.Tensor],
               forward: Callable[[Any, Any], Any] = lambda model, b: model(b[0])) -> torch.Tensor:
    """One process, plain PyTorch: the same global batches in order (by index, or stream positions)."""
    torch.set_num_threads(1)
    model, train, _ = build(exp, torch.device("cpu"))
    data = Data(train)
    opt = torch.optim.SGD(model.parameters(), lr=exp.lr, momentum=exp.momentum)
    for step in range(exp.total_steps):
        if data.stream:
            b = data.batch(data.read(step * global_batch, (step + 1) * global_batch))
        else:
            b = data.batch(sampler.sync_global_batch(len(data), global_batch, step, exp.seed))
        opt.zero_grad()
        loss(forward(model, b), b).backward()
        opt.step()
    return flatten_params(model)


def _assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.numel() == want.numel()
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("num_workers", "prefetch"), [(0, 0), (0, 3), (2, 2)])
def test_sync_with_user_loss_equals_single_process(tmp_path: Path, num_workers: int, prefetch: int) -> None:
    """Also with batches read ahead (a thread) or in DataLoader worker processes: the same samples each step."""
    exp = Experiment(**BASE, loss=f"{U}:half_squared_error", batch_size=16, num_workers=num_workers,
                     prefetch=prefetch)
    got = _train(exp, 2, tmp_path)
    _assert_equal(got, _reference(exp, 32, lambda out, b: user.half_squared_error(out, b[1])))


def test_sync_with_mse_over_three_workers_equals_single_process(tmp_path: Path) -> None:
    exp = Experiment(**BASE, loss="mse", global_batch_size=48)
    got = _train(exp, 3, tmp_path)
    _assert_equal(got, _reference(exp, 48, lambda out, b: F.mse_loss(out, b[1])))


def test_sync_on_an_endless_stream_reads_it_in_order_whatever_the_workers(tmp_path: Path) -> None:
    """Each step takes the stream's next global batch, cut over the workers: two workers equal one process."""
    exp = Experiment(**{**BASE, "dataset": f"{U}:stream_data"}, loss=f"{U}:half_squared_error", global_batch_size=32,
                     prefetch=2)
    got = _train(exp, 2, tmp_path)
    _assert_equal(got, _reference(exp, 32, lambda out, b: user.half_squared_error(out, b[1])))


def test_sync_model_computed_loss_on_dict_batches_equals_single_process(tmp_path: Path) -> None:
    """loss='model': dict batches go in as model(**batch), and its own `loss` is what trains."""
    exp = Experiment(**{**BASE, "model": f"{U}:keyword_regressor", "dataset": f"{U}:dict_data"}, loss="model",
                     batch_size=16)
    got = _train(exp, 2, tmp_path)
    _assert_equal(got, _reference(exp, 32, lambda out, b: out["loss"], forward=lambda model, b: model(**b)))


def test_sync_with_user_collate_feeds_the_model_dict_batches(tmp_path: Path) -> None:
    """`collate` turns (x, y) samples into {"features", "labels"}; cross-entropy-free mse on the logits."""
    exp = Experiment(**{**BASE, "model": f"{U}:keyword_regressor"}, loss="mse", collate=f"{U}:pairs_as_dict",
                     batch_size=16)
    got = _train(exp, 2, tmp_path)
    _assert_equal(got, _reference(exp, 32, lambda out, b: F.mse_loss(out["logits"], b[1]),
                                  forward=lambda model, b: model(features=b[0])))


def _rank_main(rank: int, world: int, port: int, exp_json: str, endpoints: dict[int, str], ckpt: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = RankContext(experiment_id="e", experiment=Experiment.from_json(exp_json), node_id="node0",
                          worker_index=0, num_workers=1, endpoints=endpoints, checkpoint_dir=ckpt,
                          local_rank=rank, local_world=world)
        ParameterServerTrainer(ctx).run()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("parallelism", "dataset"), [("fsdp", "stream_data"), ("pipeline", "tensor_data"),
                                                      ("ddp", "stream_data")])
def test_two_local_ranks_with_user_loss_equal_single_process(tmp_path: Path, parallelism: str, dataset: str) -> None:
    """One node of two ranks (fsdp rows, pipeline stages or ddp replicas), the user's loss: still the global step."""
    exp = Experiment(**{**BASE, "dataset": f"{U}:{dataset}"}, loss=f"{U}:half_squared_error", batch_size=32,
                     chunk_numel=64, parallelism=parallelism, pipeline_microbatches=4)
    shards = LocalShards(exp)
    procs: list[Any] = []
    hold = reserve_port()  # bound until the ranks are done: nobody else may take the port meanwhile
    try:
        port = hold.getsockname()[1]
        ctx = warm_context()
        procs = [ctx.Process(target=_rank_main, args=(r, 2, port, exp.to_json(), shards.endpoints, str(tmp_path)))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0, 0]
        got = shards.flat()
    finally:
        hold.close()
        for p in procs:
            if p.is_alive():
                p.kill()
        shards.close()
    _assert_equal(got, _reference(exp, 32, lambda out, b: user.half_squared_error(out, b[1])))
