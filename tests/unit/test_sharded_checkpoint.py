"""Sharded DCP checkpoints: resharding restore, corruption refused, real kill mid-write, async saves."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gossamer import CheckpointError, load_checkpoint
from gossamer.checkpoint import save_model_checkpoint
from gossamer.checkpoint.sharded import (
    AsyncCheckpointer,
    ShardSnapshot,
    complete_steps,
    latest_good,
    load_flat,
    load_sharded_model,
    restore_range,
    save_shard,
    step_dir,
    verify_step,
)
from gossamer.engine.shard_plan import ShardPlan

# DCP warns on every call without a process group; the module filters it, but pytest
# restores the warning filters it had before collection imported the module.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CHUNK = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def _layout(model: nn.Module) -> list[tuple[str, list[int]]]:
    return [(n, list(p.shape)) for n, p in model.named_parameters()]


def _snapshots(
    plan: ShardPlan,
    states: dict[str, torch.Tensor],
    step: int,
    layout: list[tuple[str, list[int]]] | None = None,
    adam_steps: list[float] | None = None,
) -> list[ShardSnapshot]:
    """One snapshot per shard of `plan`, cut from the full flat `states`; version 100 + shard."""
    snaps = []
    for s in range(plan.num_shards):
        chunks = plan.chunks_of_shard(s)
        pieces = {
            c.flat_offset: {
                k: v[c.flat_offset : c.flat_offset + c.numel].clone() for k, v in states.items()
            }
            for c in chunks
        }
        scalars = {c.flat_offset: {"step": adam_steps[s]} for c in chunks} if adam_steps else {}
        snaps.append(
            ShardSnapshot(
                experiment="exp",
                step=step,
                shard=s,
                num_shards=plan.num_shards,
                total_numel=plan.total_numel,
                version=100 + s,
                pieces=pieces,
                scalars=scalars,
                layout=layout or [],
                extra={"applied": {"w0": step}},
            )
        )
    return snaps


def _save_all(root: Path, snaps: list[ShardSnapshot]) -> Path:
    for snap in snaps:
        save_shard(root, snap)
    return step_dir(root, snaps[0].step)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, nn.Module, dict[str, torch.Tensor]]:
    """A complete 2-shard checkpoint at step 10 of random params + momentum."""
    model = _model()
    plan = ShardPlan.for_module(model, 2, chunk_numel=CHUNK)
    torch.manual_seed(1)
    states = {
        "param": torch.randn(plan.total_numel),
        "momentum_buffer": torch.randn(plan.total_numel),
    }
    step = _save_all(tmp_path, _snapshots(plan, states, 10, _layout(model)))
    return step, model, states


def test_chunks_cut_mid_parameter() -> None:
    plan = ShardPlan.for_module(_model(), 2, chunk_numel=CHUNK)
    assert any(c.param_offset for c in plan.chunks)
    assert len(plan.chunks_of_shard(0)) > 1 and len(plan.chunks_of_shard(1)) > 1


@pytest.mark.parametrize(("num_shards", "chunk_numel"), [(1, 64), (3, 5), (3, CHUNK)])
def test_restore_onto_different_shard_count(
    saved: tuple[Path, nn.Module, dict[str, torch.Tensor]], num_shards: int, chunk_numel: int
) -> None:
    step, model, states = saved
    manifests = verify_step(step)
    new_plan = ShardPlan.for_module(model, num_shards, chunk_numel=chunk_numel)
    for s in range(num_shards):
        for c in new_plan.chunks_of_shard(s):
            got, scalars, version = restore_range(step, c.flat_offset, c.numel, manifests)
            assert set(got) == {"param", "momentum_buffer"}
            for k, v in states.items():
                assert torch.equal(got[k], v[c.flat_offset : c.flat_offset + c.numel])
            assert scalars == {}
            assert version in (100, 101)
    assert restore_range(step, 0, new_plan.total_numel)[2] == 100  # min over both shards


def test_load_flat_and_model(saved: tuple[Path, nn.Module, dict[str, torch.Tensor]]) -> None:
    step, model, states = saved
    flat = load_flat(step)
    assert set(flat) == set(states)
    for k, v in states.items():
        assert torch.equal(flat[k], v)
    state = load_sharded_model(step)
    expected = states["param"].split([p.numel() for p in model.parameters()])
    assert list(state) == [n for n, _ in model.named_parameters()]
    for (name, p), e in zip(model.named_parameters(), expected, strict=True):
        assert torch.equal(state[name], e.view_as(p))
    model.load_state_dict(load_checkpoint(step))  # the public loader reads sharded dirs too
    assert torch.equal(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]), states["param"]
    )


def test_manifest_records_meta(saved: tuple[Path, nn.Module, dict[str, torch.Tensor]]) -> None:
    step, _, _ = saved
    m = json.loads((step / "shard-001" / "manifest.json").read_text())
    assert m["format"] == "gossamer-sharded/1"
    assert (m["step"], m["shard"], m["num_shards"], m["version"]) == (10, 1, 2, 101)
    assert m["extra"] == {"applied": {"w0": 10}}
    on_disk = {p.name for p in (step / "shard-001").iterdir()} - {"manifest.json"}
    assert on_disk == set(m["files"]) and ".metadata" in on_disk
    for name, entry in m["files"].items():
        blob = (step / "shard-001" / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}


def test_adam_scalar_step_survives(tmp_path: Path) -> None:
    model = _model()
    plan = ShardPlan.for_module(model, 2, chunk_numel=CHUNK)
    n = plan.total_numel
    states = {"param": torch.randn(n), "exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}
    step = _save_all(tmp_path, _snapshots(plan, states, 5, adam_steps=[12.0, 13.0]))
    for c in plan.chunks:
        got, scalars, version = restore_range(step, c.flat_offset, c.numel)
        assert scalars == {"step": [12.0, 13.0][c.shard]}
        assert version == 100 + c.shard
        assert torch.equal(
            got["exp_avg_sq"], states["exp_avg_sq"][c.flat_offset : c.flat_offset + c.numel]
        )
    assert restore_range(step, 0, n)[1] == {"step": 13.0}


def test_resave_of_a_step_replaces_it(
    saved: tuple[Path, nn.Module, dict[str, torch.Tensor]],
) -> None:
    step, model, states = saved
    plan = ShardPlan.for_module(model, 2, chunk_numel=CHUNK)
    save_shard(step.parent, _snapshots(plan, {k: v * 2 for k, v in states.items()}, 10)[0])
    flat = load_flat(step)
    for c in plan.chunks:
        want = states["param"][c.flat_offset : c.flat_offset + c.numel] * (2 if c.shard == 0 else 1)
        assert torch.equal(flat["param"][c.flat_offset : c.flat_offset + c.numel], want)
    assert sorted(p.name for p in step.iterdir()) == ["shard-000", "shard-001"]


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_step_is_refused_and_previous_used(tmp_path: Path, damage: str) -> None:
    model = _model()
    plan = ShardPlan.for_module(model, 2, chunk_numel=CHUNK)
    states = {"param": torch.randn(plan.total_numel)}
    good = _save_all(tmp_path, _snapshots(plan, states, 10, _layout(model)))
    bad = _save_all(tmp_path, _snapshots(plan, states, 20, _layout(model)))
    data = next((bad / "shard-001").glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    if damage == "truncate":
        data.write_bytes(blob[: len(blob) // 2])
    else:
        blob[len(blob) // 2] ^= 0x01
        data.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256") as err:
        verify_step(bad)
    assert data.name in str(err.value)
    assert complete_steps(tmp_path) == [bad, good]  # complete, but does not verify
    path, refused = latest_good(tmp_path)
    assert path == good
    assert [p for p, _ in refused] == [bad] and "sha256" in refused[0][1]
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(bad)


def test_missing_shard_is_incomplete_and_tmp_ignored(tmp_path: Path) -> None:
    plan = ShardPlan.for_module(_model(), 2, chunk_numel=CHUNK)
    states = {"param": torch.randn(plan.total_numel)}
    good = _save_all(tmp_path, _snapshots(plan, states, 10))
    half = step_dir(tmp_path, 20)
    save_shard(tmp_path, _snapshots(plan, states, 20)[0])
    leftover = half / ".shard-001.tmp-1-2"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step-00000030").mkdir()  # an empty step dir (a crash before any shard wrote)
    assert complete_steps(tmp_path) == [good]
    path, refused = latest_good(tmp_path)
    assert path == good
    assert [p for p, _ in refused] == [tmp_path / "step-00000030", half]
    assert "shard-001 missing" in refused[1][1]
    with pytest.raises(CheckpointError, match="shard-001"):
        verify_step(half)


KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from gossamer.checkpoint.sharded import ShardSnapshot, save_shard

    for step in (10, 20):
        for shard in (0, 1):
            piece = {shard * 4: {"param": torch.full((4,), float(step)), "exp_avg": torch.zeros(4)}}
            save_shard(sys.argv[1], ShardSnapshot("exp", step, shard, 2, 8, step, piece))
    print("survived")
    """
)


def test_kill_mid_checkpoint_leaves_previous_step(tmp_path: Path) -> None:
    env = {**os.environ, "GOSSAMER_FAULT": "die:at=mid-checkpoint:step=20"}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    assert "survived" not in proc.stdout
    step20 = step_dir(tmp_path, 20)
    assert not (step20 / "shard-000").exists()
    leftovers = list(step20.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".shard-000.tmp-")
    assert (leftovers[0] / ".metadata").exists()  # DCP had finished writing when it died
    path, refused = latest_good(tmp_path)
    assert path == step_dir(tmp_path, 10)
    assert [p for p, _ in refused] == [step20]
    assert torch.equal(load_flat(path)["param"], torch.full((8,), 10.0))


def _single(step: int, shard: int = 0, num_shards: int = 1, numel: int = 16) -> ShardSnapshot:
    off = shard * numel
    piece = {
        off: {"param": torch.full((numel,), float(step)), "momentum_buffer": torch.randn(numel)}
    }
    return ShardSnapshot("exp", step, shard, num_shards, numel * num_shards, step, piece)


def test_async_submit_returns_at_once_and_skips_while_busy(tmp_path: Path) -> None:
    gate = threading.Event()
    calls: list[tuple[Path, int, float]] = []

    def on_saved(path: Path, snap: ShardSnapshot, seconds: float) -> None:
        calls.append((path, snap.step, seconds))
        gate.wait(30)  # the save counts as running until the callback returns

    ck = AsyncCheckpointer(tmp_path, on_saved=on_saved)
    big = _single(1, numel=8 << 20)  # 2 x 32 MiB: writing and fsyncing takes a while
    t0 = time.monotonic()
    assert ck.submit(big)
    submit_seconds = time.monotonic() - t0
    assert not ck.submit(_single(2))
    assert ck.skipped == 1
    gate.set()
    ck.wait(60)
    assert (ck.saved, ck.skipped, ck.failed) == (1, 1, 0)
    assert calls == [(step_dir(tmp_path, 1) / "shard-000", 1, ck.last_seconds)]
    assert submit_seconds < 0.5 and submit_seconds < ck.last_seconds
    assert torch.equal(load_flat(step_dir(tmp_path, 1))["param"], big.pieces[0]["param"])
    ck.close()
    with pytest.raises(RuntimeError):
        ck.submit(_single(3))


def test_async_failure_is_counted(tmp_path: Path) -> None:
    ck = AsyncCheckpointer(tmp_path)
    bad = _single(1)
    bad.pieces[0]["param"] = torch.zeros(3, 3)
    assert ck.submit(bad)
    ck.wait(30)
    assert (ck.saved, ck.failed) == (0, 1)
    assert "1-D fp32" in ck.last_error
    assert not list(tmp_path.rglob("*.distcp"))


def test_keep_prunes_only_own_shard_of_old_steps(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_shard(tmp_path, _single(step, shard=1, num_shards=2))
    ck0 = AsyncCheckpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        assert ck0.submit(_single(step, shard=0, num_shards=2))
        ck0.wait(30)
    assert ck0.saved == 3
    assert complete_steps(tmp_path) == [step_dir(tmp_path, 3), step_dir(tmp_path, 2)]
    assert [p.name for p in step_dir(tmp_path, 1).iterdir()] == ["shard-001"]
    ck1 = AsyncCheckpointer(tmp_path, keep=2)
    assert ck1.submit(_single(4, shard=1, num_shards=2))  # step 4 stays incomplete
    ck1.close()
    assert not step_dir(tmp_path, 1).exists()  # emptied by shard 1, so removed
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002",
        "step-00000003",
        "step-00000004",
    ]
    assert latest_good(tmp_path)[0] == step_dir(tmp_path, 3)


def test_bad_ranges_and_non_checkpoints(
    tmp_path: Path, saved: tuple[Path, nn.Module, dict[str, torch.Tensor]]
) -> None:
    step, _, states = saved
    total = states["param"].numel()
    for start, numel in [(-1, 3), (total - 2, 5), (total, 1), (0, 0)]:
        with pytest.raises(CheckpointError, match="not inside"):
            restore_range(step, start, numel)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="manifest"):
        restore_range(empty, 0, 1)
    plain = save_model_checkpoint(tmp_path / "plain", _model().state_dict(), {"step": 1})
    with pytest.raises(CheckpointError):
        restore_range(plain, 0, 1)
    with pytest.raises(CheckpointError):
        restore_range(tmp_path / "does-not-exist", 0, 1)


def test_missing_layout_is_refused(tmp_path: Path) -> None:
    step = _save_all(tmp_path, [_single(1)])
    with pytest.raises(CheckpointError, match="layout"):
        load_sharded_model(step)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (os.getpid, ())


def test_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    step = _save_all(tmp_path, [_single(1)])
    shard = step / "shard-000"
    blob = pickle.dumps(_Evil())
    (shard / ".metadata").write_bytes(blob)
    manifest = json.loads((shard / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
    }
    (shard / "manifest.json").write_text(json.dumps(manifest))
    verify_step(step)  # checksums match: only the unpickler stands in the way
    with pytest.raises(CheckpointError, match="not allowed"):
        load_flat(step)


def _replace_metadata(step: Path, blob: bytes) -> Path:
    """`step`'s shard 0 with `blob` as its DCP metadata, its manifest's checksum updated to match."""
    shard = step / "shard-000"
    (shard / ".metadata").write_bytes(blob)
    manifest = json.loads((shard / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    (shard / "manifest.json").write_text(json.dumps(manifest))
    verify_step(step)
    return shard


def _enum_as_getattr(data: bytes) -> bytes:
    """`data` (a protocol-2+ pickle) with every DCP metadata enum member spelled as Python 3.11.0-3.11.4
    pickle it: getattr(class, member name), not class(value)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    class _AsGetattr(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if isinstance(obj, _MEM_FORMAT_ENCODING):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    buf = io.BytesIO()
    _AsGetattr(buf, protocol=2).dump(pickle.loads(data))  # noqa: S301 - our own file, written just above
    return buf.getvalue()


def test_metadata_pickled_by_python_3_11_2_loads(tmp_path: Path) -> None:
    # Debian 12's Python 3.11.2 pickles Enum members as getattr(cls, name): every restore failed there.
    step = _save_all(tmp_path, [_single(1)])
    before = load_flat(step)
    blob = _enum_as_getattr((step / "shard-000" / ".metadata").read_bytes())
    assert b"getattr" in blob
    _replace_metadata(step, blob)
    after = load_flat(step)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


class _GetattrCall:
    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        return (getattr, (Path, "cwd"))


def test_metadata_getattr_of_anything_but_a_metadata_enum_member_is_refused(tmp_path: Path) -> None:
    step = _save_all(tmp_path, [_single(1)])
    _replace_metadata(step, pickle.dumps(_GetattrCall(), protocol=2))
    with pytest.raises(CheckpointError, match="not allowed"):
        load_flat(step)
