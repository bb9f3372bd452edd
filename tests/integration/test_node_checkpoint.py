"""Node checkpoints: exact resume for ddp, fsdp and pipeline, and reshard onto other numbers of local ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gossamer import load_checkpoint
from gossamer.checkpoint.sharded import verify_step
from gossamer.examples.digits import mlp
from tests.integration._node_train import run_node as _run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each layout over 2 ranks: 40 steps straight, with a node checkpoint at step 20."""
    root = tmp_path_factory.mktemp("node")
    out = {}
    for par in ("ddp", "fsdp", "pipeline"):
        ckpt = root / par / "ckpt"
        out[par] = (ckpt / "step-00000020", _run(2, root / par / "straight", parallelism=par, steps=40,
                                                 save=str(ckpt), save_at=20))
    return out


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp", "pipeline"])
def test_resume_is_exact_for_the_same_layout(saved: dict[str, Any], tmp_path: Path, parallelism: str) -> None:
    step, straight = saved[parallelism]
    resumed = _run(2, tmp_path, parallelism=parallelism, steps=20, load=str(step))
    assert resumed["start"] == 20
    assert resumed["losses"] == straight["losses"][20:]
    assert torch.equal(resumed["flat"], straight["flat"]), (resumed["flat"] - straight["flat"]).abs().max()


@pytest.mark.parametrize(("parallelism", "world"), [("fsdp", 1), ("fsdp", 3), ("pipeline", 3)])
def test_reshard_continues_with_the_same_loss(saved: dict[str, Any], tmp_path: Path, parallelism: str,
                                              world: int) -> None:
    step, straight = saved[parallelism]
    resumed = _run(world, tmp_path, parallelism=parallelism, steps=3, load=str(step))
    assert resumed["start"] == 20
    # Same parameters, momentum and data position: the same loss, up to summation order.
    assert resumed["losses"] == pytest.approx(straight["losses"][20:23], rel=1e-5, abs=1e-7)


def test_node_checkpoint_is_sharded_and_loads_as_a_plain_state_dict(saved: dict[str, Any]) -> None:
    step, _ = saved["fsdp"]
    manifests = verify_step(step)
    assert [m["shard"] for m in manifests] == [0, 1]
    names = {n for m in manifests for _, _, states in m["pieces"] for n in states}
    assert names == {"param", "momentum_buffer"}
    extra = manifests[0]["extra"]
    assert extra["parallelism"] == "fsdp" and extra["world"] == 2 and extra["data"] == {"step": 20}
    assert {"torch", "cuda", "nccl", "hostname", "python"} <= set(extra["env"])
    model = mlp()
    model.load_state_dict(load_checkpoint(step))  # the model part reads back whole


def test_grad_clipping_by_global_norm_agrees_across_layouts(tmp_path: Path) -> None:
    """Clipping uses the node's whole-gradient norm, so fsdp and pipeline match ddp step for step."""
    got = {par: _run(2, tmp_path / par, parallelism=par, steps=5, max_grad_norm=0.05)
           for par in ("ddp", "fsdp", "pipeline")}
    for par in ("fsdp", "pipeline"):
        assert got[par]["losses"] == pytest.approx(got["ddp"]["losses"], rel=1e-4)
        assert torch.allclose(got[par]["flat"], got["ddp"]["flat"], atol=1e-6)
    unclipped = _run(2, tmp_path / "none", parallelism="fsdp", steps=5)
    assert not torch.allclose(unclipped["flat"], got["fsdp"]["flat"], atol=1e-4)  # clipping did bite
