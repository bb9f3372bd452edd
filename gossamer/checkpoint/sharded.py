"""Sharded, asynchronous, atomic checkpoints of parameter-server shards with DCP."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gossamer.checkpoint.manifest import MANIFEST, fsync_dir, recover_dir, regular_file, replace_dir
from gossamer.checkpoint.piece_stream import Pieces, PieceStream
from gossamer.core.errors import CheckpointError
from gossamer.core.faults import die_at

__all__ = [
    "FORMAT",
    "AsyncCheckpointer",
    "PieceStream",
    "ShardSnapshot",
    "complete_steps",
    "latest_good",
    "load_flat",
    "load_sharded_model",
    "restore_range",
    "save_shard",
    "step_dir",
    "verify_step",
]

log = logging.getLogger(__name__)

FORMAT = "gossamer-sharded/1"
_STEP_RE = re.compile(r"step-(\d+)")
_BLOCK = 1 << 20

@dataclass
class ShardSnapshot:
    """One shard's chunks and optimizer state at a version boundary, ready to persist.

    `pieces` maps a flat offset to 1-D fp32 tensors of equal numel: "param" plus elementwise
    optimizer state ("momentum_buffer", "exp_avg", ...); `scalars` holds per-piece scalar
    state such as AdamW's "step". `layout` is [(parameter name, shape)] in flat order.
    With a `stream`, `pieces` only describe the tensors (meta tensors of their size): the save
    asks the stream for each one as it writes it, in `pieces`' order, and says when it is
    written (a shard's live state written without a copy of it, `PendingSnapshot`).
    """

    experiment: str
    step: int
    shard: int
    num_shards: int
    total_numel: int
    version: int
    pieces: dict[int, dict[str, torch.Tensor]]
    scalars: dict[int, dict[str, float]] = field(default_factory=dict)
    layout: list[tuple[str, list[int]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    stream: PieceStream | None = None


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The directory of checkpoint `step` under `root`."""
    return Path(root) / f"step-{step:08d}"


def _shard_name(shard: int) -> str:
    return f"shard-{shard:03d}"


def _check_snapshot(snap: ShardSnapshot) -> None:
    """ValueError unless `snap` describes non-overlapping 1-D fp32 pieces inside the vector."""
    if not 0 <= snap.shard < snap.num_shards or snap.step < 0 or snap.total_numel < 0:
        raise ValueError(
            f"bad snapshot header: step {snap.step}, shard {snap.shard} of {snap.num_shards}, "
            f"total_numel {snap.total_numel}"
        )
    end = 0
    for off in sorted(snap.pieces):
        states = snap.pieces[off]
        if "param" not in states:
            raise ValueError(f"piece at {off} has no 'param'")
        n = states["param"].numel()
        for name, t in states.items():
            if t.dim() != 1 or t.dtype != torch.float32 or t.numel() != n:
                raise ValueError(f"piece at {off}: {name!r} is not a 1-D fp32 tensor of {n}")
        if off < end or off + n > snap.total_numel or n == 0:
            raise ValueError(f"piece [{off}, {off + n}) overlaps or leaves [0, {snap.total_numel})")
        end = off + n
    if not set(snap.scalars) <= set(snap.pieces):
        raise ValueError("scalars name offsets that have no piece")
    try:
        json.dumps(snap.extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra is not JSON-serialisable: {e}") from e


def _hash_file(path: Path, fsync: bool = False) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            size += len(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest(), size


def _seal_files(tmp: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file DCP wrote into `tmp`, each fsynced."""
    entries = {}
    for p in sorted(tmp.iterdir()):
        if not p.is_file():
            raise CheckpointError(f"{p}: DCP wrote something that is not a plain file")
        digest, size = _hash_file(p, fsync=True)
        entries[p.name] = {"sha256": digest, "bytes": size}
    return entries


def _manifest(snap: ShardSnapshot, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "files": files,
        "created_unix": time.time(),
        "experiment": snap.experiment,
        "step": snap.step,
        "shard": snap.shard,
        "num_shards": snap.num_shards,
        "total_numel": snap.total_numel,
        "version": snap.version,
        "pieces": [
            [off, snap.pieces[off]["param"].numel(), sorted(snap.pieces[off])]
            for off in sorted(snap.pieces)
        ],
        "scalars": {
            str(off): {k: float(v) for k, v in s.items()} for off, s in sorted(snap.scalars.items())
        },
        "layout": [[name, [int(d) for d in shape]] for name, shape in snap.layout],
        "extra": snap.extra,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def save_shard(root: str | os.PathLike[str], snap: ShardSnapshot) -> Path:
    """Write `root/step-NNNNNNNN/shard-SSS/` atomically: DCP files plus a sha256 manifest.

    DCP writes into a hidden temporary sibling; the manifest goes in last, then the directory
    is renamed into place, so a shard directory is complete or absent. The snapshot's tensors
    must not change while this runs; a streamed snapshot's (`ShardSnapshot.stream`) are read
    one at a time and released as each is written, and all of them whatever happens.

    Raises:
        ValueError: a malformed snapshot.
        CheckpointError: DCP failed to write.
    """
    try:
        return _save_shard(root, snap)
    finally:
        if snap.stream is not None:
            snap.stream.close()


def _save_shard(root: str | os.PathLike[str], snap: ShardSnapshot) -> Path:
    _check_snapshot(snap)
    parent = step_dir(root, snap.step)
    parent.mkdir(parents=True, exist_ok=True)
    fsync_dir(parent.parent)
    name = _shard_name(snap.shard)
    tmp = parent / f".{name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    from gossamer.checkpoint.dcp_io import save_pieces

    state = {f"{k}/{off}": t.detach() for off, s in snap.pieces.items() for k, t in s.items()}
    try:
        save_pieces(state, tmp, snap.stream)
        die_at("mid-checkpoint", step=snap.step, shard=snap.shard)
        _write_json(tmp / MANIFEST, _manifest(snap, _seal_files(tmp)))
        fsync_dir(tmp)
        replace_dir(tmp, parent / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return parent / name


def _step_number(path: Path) -> int:
    m = _STEP_RE.fullmatch(path.name)
    return int(m.group(1)) if m else -1


def _step_dirs(root: str | os.PathLike[str]) -> list[Path]:
    """Every `step-N` directory under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if _STEP_RE.fullmatch(p.name) and p.is_dir()]
    return sorted(dirs, key=_step_number, reverse=True)


def _read_shard_manifest(shard_dir: Path) -> dict[str, Any]:
    recover_dir(shard_dir)
    try:
        m = json.loads((shard_dir / MANIFEST).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{shard_dir}: no {MANIFEST} (missing or partial shard)") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{shard_dir / MANIFEST} is unreadable: {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        fmt = m.get("format") if isinstance(m, dict) else None
        raise CheckpointError(f"{shard_dir / MANIFEST}: not a {FORMAT} manifest ({fmt!r})")
    return m


def _declared_shards(step: Path) -> int:
    """num_shards as shard-000's manifest states it."""
    n = _read_shard_manifest(step / _shard_name(0)).get("num_shards")
    if not isinstance(n, int) or n <= 0:
        raise CheckpointError(f"{step / _shard_name(0) / MANIFEST}: bad num_shards {n!r}")
    return n


def _incomplete_reason(step: Path) -> str | None:
    """Why `step` lacks a shard (None when every shard directory has its manifest)."""
    try:
        n = _declared_shards(step)
    except CheckpointError as e:
        return f"incomplete: {e}"
    missing = [_shard_name(s) for s in range(n) if not (recover_dir(step / _shard_name(s)) / MANIFEST).is_file()]
    return f"{step}: incomplete, {', '.join(missing)} missing" if missing else None


def complete_steps(root: str | os.PathLike[str]) -> list[Path]:
    """Step directories, newest first, in which all num_shards shards finished writing."""
    return [d for d in _step_dirs(root) if _incomplete_reason(d) is None]


def _verify_files(shard_dir: Path, files: dict[str, Any]) -> None:
    for name, entry in files.items():
        path = shard_dir / name
        if "/" in name or name in ("", ".", "..", MANIFEST):
            raise CheckpointError(f"{shard_dir / MANIFEST}: bad file name {name!r}")
        if not regular_file(path):
            raise CheckpointError(f"{path}: listed in the manifest but missing or not a regular file")
        digest, size = _hash_file(path)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{path}: sha256 mismatch ({size} bytes, manifest says {entry['bytes']}): "
                "corrupt or truncated"
            )


def _check_header(shard_dir: Path, m: dict[str, Any], shard: int, first: dict[str, Any]) -> None:
    if m["shard"] != shard:
        raise CheckpointError(f"{shard_dir / MANIFEST}: says shard {m['shard']}")
    for key in ("experiment", "step", "num_shards", "total_numel"):
        if m[key] != first[key]:
            raise CheckpointError(
                f"{shard_dir / MANIFEST}: {key} {m[key]!r} disagrees with shard-000's {first[key]!r}"
            )
    label = _step_number(shard_dir.parent)
    if label >= 0 and m["step"] != label:
        raise CheckpointError(f"{shard_dir / MANIFEST}: step {m['step']} in directory of {label}")
    if m["layout"] and first["layout"] and m["layout"] != first["layout"]:
        raise CheckpointError(f"{shard_dir / MANIFEST}: layout disagrees with shard-000's")


def _check_tiling(step: Path, manifests: list[dict[str, Any]]) -> None:
    """The pieces of all shards cover [0, total_numel) exactly once, each with a param."""
    total = manifests[0]["total_numel"]
    pieces = [(p[0], p[1], "param" in p[2], m["shard"]) for m in manifests for p in m["pieces"]]
    spans = sorted(pieces)
    pos = 0
    for off, n, has_param, shard in spans:
        where = f"{step / _shard_name(shard) / MANIFEST}: piece [{off}, {off + n})"
        if off > pos:
            raise CheckpointError(f"{where}: gap, nothing saved for [{pos}, {off})")
        if off < pos or n <= 0:
            raise CheckpointError(f"{where}: overlaps another piece or is empty")
        if not has_param:
            raise CheckpointError(f"{where}: has no param")
        pos = off + n
    if pos != total:
        raise CheckpointError(f"{step}: pieces cover [0, {pos}) of [0, {total})")


def verify_step(step: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read and verify every shard manifest of a step directory; the manifests by shard.

    Checks the sha256 of every file, that the shards agree on experiment, step, num_shards
    and total_numel, and that their pieces tile [0, total_numel) with no gap or overlap.

    Raises:
        CheckpointError: naming the offending file and the cause.
    """
    step = Path(step)
    n = _declared_shards(step)
    manifests: list[dict[str, Any]] = []
    for s in range(n):
        shard_dir = step / _shard_name(s)
        m = _read_shard_manifest(shard_dir)
        try:
            _check_header(shard_dir, m, s, manifests[0] if manifests else m)
            _verify_files(shard_dir, m["files"])
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{shard_dir / MANIFEST}: malformed ({e!r})") from e
        manifests.append(m)
    try:
        _check_tiling(step, manifests)
    except (KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"{step}: malformed pieces ({e!r})") from e
    return manifests


def latest_good(root: str | os.PathLike[str]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete step that verifies, and (path, reason) of every newer one refused."""
    refused: list[tuple[Path, str]] = []
    for d in _step_dirs(root):
        reason = _incomplete_reason(d)
        if reason is None:
            try:
                verify_step(d)
                return d, refused
            except CheckpointError as e:
                reason = str(e)
        log.warning("checkpoint %s refused: %s", d, reason)
        refused.append((d, reason))
    return None, refused


def _load_pieces(shard_dir: Path, pieces: Pieces, listed: set[str]) -> dict[str, torch.Tensor]:
    """DCP-load the named pieces of one shard into tensors of their saved shape."""
    from gossamer.checkpoint.dcp_io import load_pieces

    return load_pieces(shard_dir, pieces, listed)


def _overlapping(m: dict[str, Any], start: int, end: int) -> Pieces:
    return [(off, n, names) for off, n, names in m["pieces"] if off < end and off + n > start]


def restore_range(
    step: str | os.PathLike[str],
    start: int,
    numel: int,
    manifests: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """The saved state of flat range [start, start + numel), whatever shards saved it.

    Returns (vectors by state name, scalars (max over the pieces involved), the minimum
    version of the shards involved). `manifests` is `verify_step(step)`'s result, to skip
    verifying again. This is what lets k saved shards restore onto k' != k shards.

    Raises:
        CheckpointError: the range is outside the checkpoint, a state is not saved for all
            of it, or the checkpoint is missing or corrupt.
    """
    step = Path(step)
    ms = verify_step(step) if manifests is None else manifests
    total = ms[0]["total_numel"] if ms else 0
    end = start + numel
    if numel <= 0 or start < 0 or end > total:
        raise CheckpointError(f"{step}: range [{start}, {end}) is not inside [0, {total})")
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    versions = []
    for m in ms:
        pieces = _overlapping(m, start, end)
        if not pieces:
            continue
        versions.append(int(m["version"]))
        loaded = _load_pieces(step / _shard_name(m["shard"]), pieces, set(m["files"]))
        for off, n, names in pieces:
            lo, hi = max(off, start), min(off + n, end)
            for k in names:
                dst = slice(lo - start, hi - start)
                src = loaded[f"{k}/{off}"][lo - off : hi - off]
                out.setdefault(k, torch.empty(numel))[dst] = src
                covered.setdefault(k, torch.zeros(numel, dtype=torch.bool))[dst] = True
            for k, v in m["scalars"].get(str(off), {}).items():
                scalars[k] = max(scalars.get(k, float(v)), float(v))
    _check_covered(step, covered, start, end)
    return out, scalars, min(versions)


def _check_covered(step: Path, covered: dict[str, torch.Tensor], start: int, end: int) -> None:
    if "param" not in covered:
        raise CheckpointError(f"{step}: no saved piece holds param for [{start}, {end})")
    for k, mask in covered.items():
        if not bool(mask.all()):
            first = start + int((~mask).nonzero()[0])
            raise CheckpointError(f"{step}: state {k!r} is not saved at flat offset {first}")


def load_flat(step: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The full flat vector of every saved state ("param", "momentum_buffer", ...)."""
    ms = verify_step(step)
    if ms[0]["total_numel"] == 0:
        return {}
    return restore_range(step, 0, ms[0]["total_numel"], ms)[0]


def load_sharded_model(step: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A model state_dict (parameters only) rebuilt from the saved layout.

    Raises:
        CheckpointError: the checkpoint is incomplete or corrupt, or saved no layout.
    """
    ms = verify_step(step)
    layout = next((m["layout"] for m in ms if m["layout"]), None)
    if not layout:
        raise CheckpointError(f"{step}: no parameter layout was saved; use load_flat")
    total = ms[0]["total_numel"]
    sizes = [math.prod(shape) for _, shape in layout]
    if sum(sizes) != total:
        raise CheckpointError(f"{step}: layout holds {sum(sizes)} elements, checkpoint {total}")
    flat = restore_range(step, 0, total, ms)[0] if total else {"param": torch.empty(0)}
    if "param" not in flat:
        raise CheckpointError(f"{step}: no param state saved")
    parts = flat["param"].split(sizes)
    return {name: p.view(shape).clone() for (name, shape), p in zip(layout, parts, strict=True)}


def _prune(root: Path, shard: int, keep: int) -> None:
    """Delete this shard's dirs of steps older than the newest `keep` complete steps."""
    kept = complete_steps(root)[:keep]
    if not kept:
        return
    oldest = _step_number(kept[-1])
    name = _shard_name(shard)
    for d in _step_dirs(root):
        if _step_number(d) >= oldest:
            continue
        try:
            for p in d.iterdir():
                if p.name == name or p.name.startswith(f".{name}."):
                    shutil.rmtree(p, ignore_errors=True)
            d.rmdir()
        except OSError:
            pass  # other shards' directories are still in it, or another shard removed it


class AsyncCheckpointer:
    """Persists one shard's snapshots in a background thread, at most one save at a time.

    A snapshot submitted while a save runs is skipped, not queued: a newer one will follow,
    and queueing would let a slow disk pile up memory.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        on_saved: Callable[[Path, ShardSnapshot, float], None] | None = None,
        keep: int = 3,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.on_saved = on_saved
        self.keep = keep
        self.saved = 0
        self.skipped = 0
        self.failed = 0
        self.last_seconds = 0.0
        self.last_error = ""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, snap: ShardSnapshot) -> bool:
        """Start persisting `snap`, which the checkpointer now owns: do not modify its tensors.

        Returns at once; False (and counts it in `skipped`) if a save is still running.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncCheckpointer is closed")
            if self._thread is not None and self._thread.is_alive():
                self.skipped += 1
                return False
            self._thread = threading.Thread(
                target=self._run, args=(snap,), name=f"checkpoint-shard-{snap.shard}", daemon=True
            )
            self._thread.start()
        return True

    @property
    def busy(self) -> bool:
        """A save is running: a snapshot submitted now would be skipped (so need not be taken)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _run(self, snap: ShardSnapshot) -> None:
        t0 = time.monotonic()
        try:
            path = save_shard(self.root, snap)
        except Exception as e:
            self.failed += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.exception("checkpoint of shard %d at step %d failed", snap.shard, snap.step)
            return
        self.last_seconds = time.monotonic() - t0
        self.saved += 1
        try:
            _prune(self.root, snap.shard, self.keep)
            if self.on_saved is not None:
                self.on_saved(path, snap, self.last_seconds)
        except Exception as e:
            self.last_error = f"after saving {path}: {type(e).__name__}: {e}"
            log.exception("after saving %s", path)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running save (if any) has finished, or `timeout` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Refuse further snapshots and wait for the running save (at most `timeout` seconds)."""
        with self._lock:
            self._closed = True
        self.wait(timeout)
