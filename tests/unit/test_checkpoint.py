"""Checkpoints: atomic directories, sha256 manifest, corrupt files refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gossamer import CheckpointError, load_checkpoint
from gossamer.checkpoint import save_model_checkpoint
from gossamer.examples.digits import mlp


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = mlp()
    path = save_model_checkpoint(tmp_path / "ck", model.state_dict(), {"step": 5})
    other = mlp(hidden=128)
    other.load_state_dict(load_checkpoint(path))
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob(".ck.tmp-*")), "temporary directory left behind"


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete"])
def test_damaged_checkpoint_is_refused(tmp_path: Path, damage: str) -> None:
    path = save_model_checkpoint(tmp_path / "ck", mlp().state_dict(), {"step": 1})
    f = path / "model.pt"
    blob = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(blob[: len(blob) // 2])
    elif damage == "bitflip":
        blob[len(blob) // 2] ^= 0x01
        f.write_bytes(bytes(blob))
    else:
        f.unlink()
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_directory_without_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="manifest"):
        load_checkpoint(tmp_path)
