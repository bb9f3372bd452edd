"""Checkpoint replacement never loses the old copy (a crash between the renames is recovered), and a
crafted DCP `.metadata` naming files outside its shard is refused."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gossamer import CheckpointError, load_checkpoint
from gossamer.checkpoint.sharded import ShardSnapshot, load_flat, save_shard, step_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# Saves a model checkpoint at `final` twice (weights 1, then 2), and a shard of step 5 twice.
_SAVE_TWICE = textwrap.dedent(
    """
    import sys, torch
    from gossamer.checkpoint import save_model_checkpoint
    from gossamer.checkpoint.sharded import ShardSnapshot, save_shard
    root = sys.argv[1]
    for value in (1.0, 2.0):
        if sys.argv[2] == "model":
            save_model_checkpoint(root + "/final", {"w": torch.full((4,), value)}, {"step": int(value)})
        else:
            piece = {0: {"param": torch.full((8,), value)}}
            save_shard(root, ShardSnapshot("exp", 5, 0, 1, 8, int(value), piece))
    print("survived")
    """
)


def _save_twice_dying_at(root: Path, kind: str, point: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GOSSAMER_FAULT": f"die:at={point}"}
    return subprocess.run([sys.executable, "-c", _SAVE_TWICE, str(root), kind], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("point", ["replace-aside", "replace-swapped"])
def test_crash_while_replacing_final_checkpoint_leaves_a_loadable_one(tmp_path: Path, point: str) -> None:
    proc = _save_twice_dying_at(tmp_path, "model", point)
    assert proc.returncode == -9, proc.stderr  # SIGKILLed at the named point, not finished
    assert "survived" not in proc.stdout
    if point == "replace-aside":
        # The first save had nothing to move aside; the second died with the old copy renamed
        # aside and the new one not yet in place: no `final` directory at all on disk.
        assert not (tmp_path / "final").exists()
        assert any(p.name.startswith(".final.old-") for p in tmp_path.iterdir())
        expected = 1.0
    else:
        expected = 1.0 if not any(p.name.startswith(".final.old-") for p in tmp_path.iterdir()) else 2.0
    state = load_checkpoint(tmp_path / "final")
    assert torch.equal(state["w"], torch.full((4,), expected))
    assert (tmp_path / "final" / "manifest.json").is_file()


def test_crash_while_replacing_a_shard_leaves_the_previous_shard(tmp_path: Path) -> None:
    proc = _save_twice_dying_at(tmp_path, "shard", "replace-aside")
    assert proc.returncode == -9, proc.stderr
    step = step_dir(tmp_path, 5)
    assert not (step / "shard-000").exists()
    assert torch.equal(load_flat(step)["param"], torch.full((8,), 1.0))
    assert (step / "shard-000" / "manifest.json").is_file()  # renamed back by the loader


def test_replacement_without_crash_keeps_only_the_new_copy(tmp_path: Path) -> None:
    proc = _save_twice_dying_at(tmp_path, "model", "nowhere")
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    assert torch.equal(load_checkpoint(tmp_path / "final")["w"], torch.full((4,), 2.0))


def _saved_shard(root: Path) -> Path:
    save_shard(root, ShardSnapshot("exp", 1, 0, 1, 16, 1, {0: {"param": torch.arange(16.0)}}))
    return step_dir(root, 1)


def _rewrite_metadata(shard: Path, relative_path: str, extra_files: dict[str, bytes] | None = None) -> None:
    """Point every storage entry of the shard's real `.metadata` at `relative_path`, and re-seal
    the manifest so that checksums match (only the path checks stand in the way)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    metadata = FileSystemReader(shard).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    blob = pickle.dumps(metadata)
    (shard / ".metadata").write_bytes(blob)
    manifest = json.loads((shard / "manifest.json").read_text())
    for name, data in {".metadata": blob, **(extra_files or {})}.items():
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (shard / "manifest.json").write_text(json.dumps(manifest))


def test_metadata_naming_an_absolute_path_is_refused(tmp_path: Path) -> None:
    step = _saved_shard(tmp_path / "ckpt")
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((step / "shard-000" / "__0_0.distcp").read_bytes())
    _rewrite_metadata(step / "shard-000", str(outside))
    with pytest.raises(CheckpointError, match="only bare file names"):
        load_flat(step)


def test_metadata_naming_a_parent_directory_file_is_refused(tmp_path: Path) -> None:
    step = _saved_shard(tmp_path / "ckpt")
    (step / "stolen.distcp").write_bytes((step / "shard-000" / "__0_0.distcp").read_bytes())
    _rewrite_metadata(step / "shard-000", "../stolen.distcp")
    with pytest.raises(CheckpointError, match=r"'\.\./stolen\.distcp'"):
        load_flat(step)


def test_metadata_naming_an_unlisted_file_is_refused(tmp_path: Path) -> None:
    step = _saved_shard(tmp_path / "ckpt")
    shard = step / "shard-000"
    (shard / "extra.distcp").write_bytes((shard / "__0_0.distcp").read_bytes())
    _rewrite_metadata(shard, "extra.distcp")
    with pytest.raises(CheckpointError, match="manifest does not list"):
        load_flat(step)


def test_metadata_naming_a_fifo_is_refused(tmp_path: Path) -> None:
    step = _saved_shard(tmp_path / "ckpt")
    shard = step / "shard-000"
    # A FIFO listed in the manifest would block the loader forever on open(); refused unopened.
    os.mkfifo(shard / "pipe.distcp")
    _rewrite_metadata(shard, "pipe.distcp", {"pipe.distcp": b""})
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_flat(step)


def test_symlink_listed_in_the_manifest_is_refused(tmp_path: Path) -> None:
    step = _saved_shard(tmp_path / "ckpt")
    shard = step / "shard-000"
    real = (shard / "__0_0.distcp").read_bytes()
    (tmp_path / "elsewhere.distcp").write_bytes(real)
    os.remove(shard / "__0_0.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", shard / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_flat(step)
