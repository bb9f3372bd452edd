"""The copies a shard does not make: its initial values, replies, checkpoint snapshots, SYNC loads and sync sums."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from gossamer.checkpoint import save_model_checkpoint
from gossamer.checkpoint.manifest import read_manifest
from gossamer.checkpoint.sharded import AsyncCheckpointer, save_shard, step_dir
from gossamer.core.protocol import PushMeta, chunk_key
from gossamer.paramserver import (
    OptimizerConfig,
    ShardConfig,
    ShardPlan,
    ShardServer,
    flatten_params,
    take_shard_values,
)
from gossamer.paramserver._copy_on_write import storage_of
from gossamer.paramserver._state import ShardState
from gossamer.transport.frames import Message

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SGD = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _plan() -> ShardPlan:
    return ShardPlan.for_module(_model(), 2, chunk_numel=100)


def _config(shard: int = 0, mode: str = "async", optimizer: OptimizerConfig = SGD, **kw: object) -> ShardConfig:
    return ShardConfig(experiment="mem", shard=shard, mode=mode, staleness=None, optimizer=optimizer,
                       total_steps=1000, **kw)  # type: ignore[arg-type]


def _state(plan: ShardPlan, shard: int = 0) -> ShardState:
    flat = flatten_params(_model())
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks_of_shard(shard)}
    return ShardState(_config(shard), plan, init, {}, own_init=True)


def _grads(state: ShardState, value: float = 1.0) -> dict[int, torch.Tensor]:
    return {idx: torch.full_like(p, value) for idx, p in state.params.items()}


@dataclass
class Reader:
    """A send reading the live values (the role a ZMQ MessageTracker plays)."""

    done: bool


def test_take_shard_values_reads_each_chunk_and_empties_the_model() -> None:
    plan = _plan()
    flat = flatten_params(_model())
    for shard in range(plan.num_shards):
        model = _model()
        values = take_shard_values(model, plan, shard)
        assert sorted(values) == sorted(c.index for c in plan.chunks_of_shard(shard))
        for c in plan.chunks_of_shard(shard):
            torch.testing.assert_close(values[c.index], flat[c.flat_offset : c.flat_offset + c.numel], rtol=0, atol=0)
        # Each parameter is dropped once read: the shard never holds the model and its chunks together.
        assert all(p.numel() == 0 for p in model.parameters())


def test_a_shard_takes_its_init_without_a_copy_unless_asked_to_keep_it() -> None:
    plan = _plan()
    init = {c.index: torch.randn(c.numel) for c in plan.chunks_of_shard(0)}
    taken = ShardState(_config(), plan, init, {}, own_init=True)
    assert all(taken.params[i].data_ptr() == init[i].data_ptr() for i in init)
    copied = ShardState(_config(), plan, init, {})
    assert all(copied.params[i].data_ptr() != init[i].data_ptr() for i in init)


def test_a_write_steps_in_place_once_the_sends_reading_the_values_are_done() -> None:
    state = _state(_plan())
    ptrs = {i: p.data_ptr() for i, p in state.params.items()}
    state.lend(Reader(done=True))
    state.step(_grads(state), 1.0, schedule=False)
    assert {i: p.data_ptr() for i, p in state.params.items()} == ptrs
    assert state.cow_copies == 0


def test_a_write_leaves_the_values_a_send_still_reads_untouched() -> None:
    state = _state(_plan())
    sent = {i: p.detach() for i, p in state.params.items()}  # what a reply hands ZMQ (no copy)
    before = {i: t.clone() for i, t in sent.items()}
    reader = Reader(done=False)
    state.lend(reader)
    state.step(_grads(state), 1.0, schedule=False)
    assert state.cow_copies == 1
    for i, t in sent.items():
        torch.testing.assert_close(t, before[i], rtol=0, atol=0)  # the send still reads version 0
        assert not torch.equal(state.params[i], before[i])  # the state moved on, in its own storage
    # A released reader is forgotten: the next write is in place again.
    reader.done = True
    ptrs = {i: p.data_ptr() for i, p in state.params.items()}
    state.step(_grads(state), 1.0, schedule=False)
    assert {i: p.data_ptr() for i, p in state.params.items()} == ptrs
    assert state.cow_copies == 1


def test_a_snapshot_opens_without_copying_and_holds_its_version_across_a_write() -> None:
    state = _state(_plan())
    state.step(_grads(state), 1.0, schedule=False)  # momentum exists
    expected = state.snapshot(7)  # the copying snapshot of version 1
    pending = state.open_snapshot(7)
    pieces = pending.snapshot.pieces
    assert all(t.device.type == "meta" for entry in pieces.values() for t in entry.values())  # nothing copied
    last = max(pieces)
    kept = {name: pending.take(last, name).clone() for name in pieces[last]}
    for name in pieces[last]:
        pending.written(last, name)  # the writer wrote the last chunk
    state.step(_grads(state, 3.0), 1.0, schedule=False)  # the write leaves the rest to the snapshot
    assert pending.finish_seconds == 0.0 and pending.pieces_aside == 2 * (len(pieces) - 1)
    snap = pending.read_all()
    snap.pieces[last] = kept
    assert snap.version == expected.version == 1
    assert sorted(snap.pieces) == sorted(expected.pieces)
    for off, entry in expected.pieces.items():
        assert sorted(snap.pieces[off]) == sorted(entry) == ["momentum_buffer", "param"]
        for name, t in entry.items():
            torch.testing.assert_close(snap.pieces[off][name], t, rtol=0, atol=0)


def test_the_checkpointer_writes_a_whole_snapshot_from_the_live_state(tmp_path: Path) -> None:
    state, other = _state(_plan()), _state(_plan(), shard=1)
    state.step(_grads(state), 1.0, schedule=False)
    other.step(_grads(other), 1.0, schedule=False)
    expected = state.snapshot(3)
    save_shard(tmp_path, other.snapshot(3))  # the other shard's part of the step
    ck = AsyncCheckpointer(tmp_path)
    pending = state.open_snapshot(3)
    assert ck.submit(pending.snapshot)
    ck.wait(30)
    assert ck.saved == 1 and pending.done
    meta, tensors = state.read_checkpoint(str(step_dir(tmp_path, 3)))
    assert meta.state_version == 1
    for idx, c in state.chunks.items():
        for name, t in expected.pieces[c.flat_offset].items():
            key = chunk_key(idx) if name == "param" else f"{chunk_key(idx)}/{name}"
            torch.testing.assert_close(tensors[key], t, rtol=0, atol=0)
    ptrs = [p.data_ptr() for p in state.params.values()]
    state.step(_grads(state), 1.0, schedule=False)
    assert [p.data_ptr() for p in state.params.values()] == ptrs  # written: the state steps in place again


def test_a_sync_load_takes_the_optimizer_state_it_is_given() -> None:
    plan = _plan()
    src, dst = _state(plan), _state(plan)
    src.step(_grads(src), 1.0, schedule=False)
    meta, tensors = src.export()
    dst.load(meta, tensors)
    for i, p in dst.params.items():
        buf = dst.optimizer.state[p]["momentum_buffer"]
        assert buf.data_ptr() == tensors[f"{chunk_key(i)}/momentum_buffer"].data_ptr()
        torch.testing.assert_close(p, src.params[i], rtol=0, atol=0)


def test_a_sync_step_sums_into_the_first_contribution_without_a_copy() -> None:
    plan = _plan()
    flat = flatten_params(_model())
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks_of_shard(0)}
    server = ShardServer(_config(mode="sync"), plan, init)
    server.bind()
    try:
        updates = server._updates  # noqa: SLF001 — the apply rule itself, without the serve loop
        seen: list[dict[int, torch.Tensor]] = []
        step = updates.state.step
        updates.state.step = lambda grads, f, schedule, **kw: (seen.append(grads), step(grads, f, schedule=schedule, **kw))[1]  # type: ignore[method-assign]
        pushes = []
        for w in range(2):
            tensors = {chunk_key(i): torch.full((plan.chunks[i].numel,), float(w + 1)) for i in init}
            meta = PushMeta(clock=0, basis=0, pull_codec="none", step=0, num_workers=2, generation=0).to_meta()
            pushes.append(Message(op="PUSH", experiment="mem", shard=0, sender=f"w{w}", meta={**meta, "rid": w},
                                  tensors=tensors))
        with server._lock:  # noqa: SLF001
            for w, msg in enumerate(pushes):
                updates.on_push(f"id{w}".encode(), msg, time.monotonic())
        assert len(seen) == 1
        first = sorted(pushes, key=lambda m: m.sender)[0]
        for i, g in seen[0].items():
            assert g.data_ptr() == first.tensors[chunk_key(i)].data_ptr()  # summed in place, no clone
            torch.testing.assert_close(g, torch.full_like(g, 3.0), rtol=0, atol=0)
    finally:
        server.close()


def test_a_busy_checkpointer_says_so(tmp_path: Path) -> None:
    ck = AsyncCheckpointer(tmp_path)
    release = threading.Event()
    ck._thread = threading.Thread(target=release.wait)  # noqa: SLF001 — a save that is still running
    ck._thread.start()  # noqa: SLF001
    assert ck.busy
    release.set()
    ck.wait(5)
    assert not ck.busy


def test_a_model_checkpoint_is_streamed_to_its_file(tmp_path: Path) -> None:
    model = _model()
    flat = flatten_params(model)
    offset = 0
    for p in model.parameters():  # views of one flat buffer, as a worker's parameters are
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    path = save_model_checkpoint(tmp_path / "final", model.state_dict(), {"step": 1})
    manifest = read_manifest(path)  # verifies the sha256 of what was streamed
    assert manifest["files"]["model.pt"]["bytes"] == (path / "model.pt").stat().st_size
    loaded = torch.load(path / "model.pt", weights_only=True)
    for k, t in model.state_dict().items():
        torch.testing.assert_close(loaded[k], t, rtol=0, atol=0)
        assert loaded[k].untyped_storage().nbytes() == t.numel() * 4  # its own storage, not the flat buffer


def test_a_client_takes_replies_of_its_largest_shard() -> None:
    from gossamer.paramserver import ShardClient

    plan = ShardPlan.build([("w", 100_000_000)], 1)  # 400 MB on one shard: over the 256 MB default
    client = ShardClient(experiment="mem", sender="w:0", plan=plan, endpoints={0: "tcp://127.0.0.1:9"})
    try:
        assert client.limits.max_message_bytes >= 4 * 100_000_000
    finally:
        client.close()


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_large_optimizer_steps_tensor_by_tensor(name: str) -> None:
    from gossamer.paramserver.optimizer import FOREACH_MAX_NUMEL, build_optimizer

    config = OptimizerConfig(name=name, lr=0.1, momentum=0.9 if name == "sgd" else 0.0, nesterov=name == "sgd")
    small = build_optimizer(config, [torch.zeros(1000)])
    big = build_optimizer(config, [torch.empty(FOREACH_MAX_NUMEL // 2 + 1), torch.empty(FOREACH_MAX_NUMEL // 2)])
    assert small.defaults["foreach"] is None  # torch's choice: multi-tensor kernels for small models
    assert big.defaults["foreach"] is False  # no temporaries the size of everything it steps


_FREED_RSS = """
import sys, torch
from gossamer.engine.allocator import mmap_large_allocations
if sys.argv[1] == "on":
    mmap_large_allocations()
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) // 1024
a = torch.ones(1 << 20)  # 4 MiB, mmapped; freeing it raises glibc's adaptive threshold past 2 MiB
del a
base = rss()
held = [torch.ones(1 << 19) for _ in range(64)]  # 64 x 2 MiB, as a step's buffers
keep = held[-1]  # one still alive on top of the heap
del held
print(rss() - base)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_role_processes_hand_freed_buffers_back_to_the_os() -> None:
    import os
    import subprocess
    import sys

    def resident_after_free(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FREED_RSS, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        return int(out.stdout.split()[-1])

    assert resident_after_free("on") < 32  # MB: the 2 MiB buffer still held, and noise
    # The control: glibc's default keeps the freed 126 MB resident in its heap.
    assert resident_after_free("off") > 64


def test_a_snapshot_keeps_the_storage_a_send_still_reads_instead_of_copying_it() -> None:
    state = _state(_plan())
    state.step(_grads(state), 1.0, schedule=False)
    expected = state.snapshot(5)
    old = {c.flat_offset: state.params[i].data_ptr() for i, c in state.chunks.items()}
    pending = state.open_snapshot(5)
    state.lend(Reader(done=False))  # a reply of this version is still being sent
    state.step(_grads(state, 2.0), 1.0, schedule=False)
    assert state.cow_copies == 1
    for off in expected.pieces:
        assert pending.take(off, "param").data_ptr() == old[off]  # the old storage, not a third copy
    snap = pending.read_all()
    for off, entry in expected.pieces.items():
        for name, t in entry.items():
            torch.testing.assert_close(snap.pieces[off][name], t, rtol=0, atol=0)
    assert all(p.data_ptr() not in old.values() for p in state.params.values())


@pytest.mark.parametrize("optimizer", [SGD, OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True),
                                       OptimizerConfig(name="adamw", lr=0.01)])
def test_a_step_taken_a_group_of_chunks_at_a_time_is_the_whole_step_bit_for_bit(
        optimizer: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync step summed from encoded pushes asks for its gradient a group of chunks at a time (no whole sum):
    each group at most `STEP_GROUP_BYTES`, every chunk once, and the state after is the whole step's, bitwise."""
    from gossamer.paramserver import _state as state_module

    plan = _plan()
    flat = flatten_params(_model())
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks_of_shard(0)}
    whole, grouped = (ShardState(_config(optimizer=optimizer), plan, {i: v.clone() for i, v in init.items()}, {},
                                 own_init=True) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    monkeypatch.setattr(state_module, "STEP_GROUP_BYTES", 4 * 250)
    asked: list[list[int]] = []
    for _ in range(3):
        grads = {idx: torch.randn(p.numel(), generator=g) for idx, p in whole.params.items()}

        def by_group(chunks: list[int], grads: dict[int, torch.Tensor] = grads) -> dict[int, torch.Tensor]:
            asked.append(chunks)
            return {i: grads[i].clone() for i in chunks}

        whole.step({i: t.clone() for i, t in grads.items()}, 1.0, schedule=True)
        grouped.step(by_group, 1.0, schedule=True)
    per_step = len(asked) // 3
    assert per_step > 1 and all(sum(4 * plan.chunks[i].numel for i in c) <= 4 * 250 for c in asked)
    assert sorted(i for c in asked[:per_step] for i in c) == sorted(whole.params)
    assert whole.version == grouped.version == 3
    for idx, p in whole.params.items():
        assert torch.equal(p, grouped.params[idx]), idx
        for key, v in whole.optimizer.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(grouped.optimizer.state[grouped.params[idx]][key]))


def test_a_sync_exports_the_live_state_and_a_step_while_it_is_sent_writes_aside() -> None:
    """A SYNC to a backup sends the state itself, not a copy (2x the shard beside it): lent to the send, a step
    meanwhile writes the values and the momentum out of place, so the SYNC still carries the version it named."""
    plan = _plan()
    state = _state(plan)
    state.step(_grads(state), 1.0, schedule=False)  # momentum exists
    before = {i: p.clone() for i, p in state.params.items()}
    momentum = {i: state.optimizer.state[p]["momentum_buffer"].clone() for i, p in state.params.items()}
    _, tensors = state.export(copy=False)
    live = {storage_of(p) for p in state.params.values()} | {
        storage_of(state.optimizer.state[p]["momentum_buffer"]) for p in state.params.values()}
    assert {storage_of(t) for t in tensors.values()} == live  # no copy
    reader = Reader(done=False)
    state.lend(reader, tensors.values())
    state.step(_grads(state, 2.0), 1.0, schedule=False)
    for idx in state.params:
        assert torch.equal(tensors[chunk_key(idx)], before[idx])
        assert torch.equal(tensors[f"{chunk_key(idx)}/momentum_buffer"], momentum[idx])
        assert not torch.equal(state.params[idx], before[idx])
    reader.done = True
    moved = {storage_of(p) for p in state.params.values()}
    state.step(_grads(state), 1.0, schedule=False)  # the send is done: in place again
    assert {storage_of(p) for p in state.params.values()} == moved
