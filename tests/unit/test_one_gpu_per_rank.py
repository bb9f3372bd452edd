"""Two local ranks on one GPU are refused by name before NCCL's first collective (identities exchanged over gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from gossamer.core.errors import ConfigError
from gossamer.engine.process_group import check_one_gpu_per_rank, shared_gpu
from gossamer.node.ports import reserve_port

pytestmark = pytest.mark.timeout(120)


def test_the_first_two_ranks_on_one_gpu_are_named() -> None:
    assert shared_gpu(["GPU-a", "GPU-b"]) is None
    assert shared_gpu(["GPU-a", "GPU-b", "GPU-a", "GPU-b"]) == (0, 2, "GPU-a")
    assert shared_gpu(["", ""]) is None  # unknown identities are not taken for one GPU
    assert shared_gpu(["GPU-a", "GPU-a"]) == (0, 1, "GPU-a")


def _rank(rank: int, world: int, port: int, ids: list[str], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        check_one_gpu_per_rank(world, ids[rank])
        said = ""
    except ConfigError as e:
        said = str(e)
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(said))


def _run(ids: list[str], tmp_path: Path) -> list[str]:
    with reserve_port() as hold:
        mp.start_processes(_rank, args=(len(ids), hold.getsockname()[1], ids, str(tmp_path)),
                           nprocs=len(ids), start_method="spawn")
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(len(ids))]


def test_ranks_sharing_a_gpu_all_refuse_naming_nproc_per_node(tmp_path: Path) -> None:
    said = _run(["GPU-5e1f", "GPU-5e1f"], tmp_path)
    assert said[0] == said[1] and said[0].startswith("nproc_per_node: local ranks 0 and 1 are both on GPU GPU-5e1f")


def test_ranks_on_their_own_gpus_go_on(tmp_path: Path) -> None:
    assert _run(["GPU-5e1f", "GPU-77aa"], tmp_path) == ["", ""]
