"""A crafted DCP `.metadata` names files outside its shard directory, and the loader reads them.

Issue 15 ("Smaller"): "a crafted DCP `.metadata` can name files outside its directory (absolute
paths, `..`, FIFOs)". Here, in-process through the tree's checkpoint module: two real shard
checkpoints are written with `save_shard` (victim: param = 1.0, elsewhere: param = 7.0); the
victim's `.metadata` is rewritten to name the other checkpoint's data file, once by absolute
path and once by a `../` path, and its manifest's sha256 updated to match (whoever can write
the directory can write both). Then `load_flat` of the victim step. PASS: both loads are refused
(CheckpointError), none returns the 7.0 read from outside the directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

from _common import Outcome, main

NAME = "dcp_metadata"
NUMEL = 64


def _snapshot(value: float) -> object:
    import torch

    from gossamer.checkpoint.sharded import ShardSnapshot

    return ShardSnapshot(experiment="repro", step=1, shard=0, num_shards=1, total_numel=NUMEL, version=1,
                         pieces={0: {"param": torch.full((NUMEL,), value)}}, layout=[("w", [NUMEL])])


def _craft(shard_dir: Path, target: str) -> None:
    """Point every storage entry of `shard_dir/.metadata` at `target`; re-seal the manifest."""
    meta_path = shard_dir / ".metadata"
    md = pickle.loads(meta_path.read_bytes())
    md.storage_data = {k: dataclasses.replace(v, relative_path=target) for k, v in md.storage_data.items()}
    meta_path.write_bytes(pickle.dumps(md))
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    data = meta_path.read_bytes()
    manifest["files"][".metadata"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (shard_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _attempt(root: Path, how: str) -> dict:  # type: ignore[type-arg]
    from gossamer.checkpoint.sharded import load_flat, save_shard

    victim = save_shard(root / f"victim-{how}", _snapshot(1.0))
    other = save_shard(root / f"elsewhere-{how}", _snapshot(7.0))
    data = next(p for p in os.listdir(other) if p.endswith(".distcp"))
    outside = other / data
    target = str(outside) if how == "absolute" else os.path.relpath(outside, victim)
    _craft(victim, target)
    try:
        flat = load_flat(victim.parent)
    except Exception as e:  # noqa: BLE001 - a refusal is the expected outcome
        return {"target": target, "outcome": f"refused: {type(e).__name__}: {str(e)[:200]}", "read_outside": False}
    value = float(flat["param"][0])
    return {"target": target, "outcome": f"loaded param[0] = {value}", "read_outside": value == 7.0}


def run(label: str) -> Outcome:
    root = Path(tempfile.mkdtemp(prefix="repro15-dcp-"))
    try:
        checks = {how: _attempt(root, how) for how in ("absolute", "dotdot")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    passed = all(c["outcome"].startswith("refused") for c in checks.values())
    figure = "; ".join(f"{how} path: {c['outcome'][:120]}{' (READ FROM OUTSIDE)' if c['read_outside'] else ''}"
                       for how, c in checks.items())
    return Outcome(NAME, passed, figure, checks)


if __name__ == "__main__":
    main(NAME, run)
