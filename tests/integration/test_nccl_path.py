"""The NCCL path: the same node training on CUDA devices (skipped, with the reason, where there are none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration._node_train import run_node as _run

pytestmark = pytest.mark.timeout(300)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
one_gpu = pytest.mark.skipif(GPUS < 1, reason="no CUDA device: the NCCL path runs only where CUDA is available")
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"the NCCL path over 2 local ranks needs 2 CUDA devices; found {GPUS}")


@two_gpus
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp", "pipeline"])
def test_nccl_matches_gloo_for_each_layout(tmp_path: Path, parallelism: str) -> None:
    gloo = _run(2, tmp_path / "gloo", parallelism=parallelism, steps=10)
    nccl = _run(2, tmp_path / "nccl", parallelism=parallelism, steps=10, backend="nccl")
    assert nccl["device"].startswith("cuda")
    assert nccl["losses"] == pytest.approx(gloo["losses"], rel=1e-3)
    assert torch.allclose(nccl["flat"], gloo["flat"], atol=1e-3)


@two_gpus
def test_nccl_fsdp_resume_is_exact(tmp_path: Path) -> None:
    straight = _run(2, tmp_path / "a", parallelism="fsdp", steps=10, backend="nccl", save=str(tmp_path / "ck"),
                    save_at=5)
    resumed = _run(2, tmp_path / "b", parallelism="fsdp", steps=5, backend="nccl",
                   load=str(tmp_path / "ck" / "step-00000005"))
    assert torch.equal(resumed["flat"], straight["flat"])


@one_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_one_gpu(tmp_path: Path, precision: str) -> None:
    got = _run(1, tmp_path, parallelism="ddp", steps=60, backend="nccl", precision=precision)
    assert got["device"] == "cuda:0"
    assert got["losses"][-1] < 0.6 * got["losses"][0]
    assert got["skipped"] <= 3  # fp16: the scaler backs off from 2^16 in a few overflowed steps at most
