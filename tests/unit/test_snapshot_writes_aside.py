"""A checkpoint snapshot costs serving no copy: it is written from the live state; updates write what it has
not written yet out of place (the same bits), or wait for the writer past a small budget."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gossamer.checkpoint.sharded import ShardSnapshot, save_shard, step_dir
from gossamer.core.protocol import chunk_key
from gossamer.paramserver import OptimizerConfig, ShardConfig, ShardPlan
from gossamer.paramserver._copy_on_write import WritesAside, storage_of
from gossamer.paramserver._snapshot import PendingSnapshot
from gossamer.paramserver._state import ShardState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

OPTIMIZERS = {
    "sgd": OptimizerConfig(name="sgd", lr=0.1),
    "momentum": OptimizerConfig(name="sgd", lr=0.1, momentum=0.9),
    "nesterov_wd": OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamw": OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1),
    "delayed": OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, delayed=True),
}


def _state(optimizer: OptimizerConfig, chunks: int = 6, numel: int = 500) -> ShardState:
    plan = ShardPlan.build([("w", chunks * numel)], 1, chunk_numel=numel)
    config = ShardConfig(experiment="cow", shard=0, mode="async", staleness=None, optimizer=optimizer,
                         total_steps=1000)
    gen = torch.Generator().manual_seed(0)
    init = {c.index: torch.randn(c.numel, generator=gen) for c in plan.chunks_of_shard(0)}
    state = ShardState(config, plan, init, {}, own_init=True)
    state.set_delay(2)
    return state


def _grads(state: ShardState, seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {idx: torch.randn(p.numel(), generator=gen) for idx, p in sorted(state.params.items())}


def _assert_same_state(a: ShardState, b: ShardState) -> None:
    for idx in a.params:
        assert torch.equal(a.params[idx], b.params[idx])
        sa, sb = a.optimizer.state[a.params[idx]], b.optimizer.state[b.params[idx]]
        assert sorted(sa) == sorted(sb)
        for name, val in sa.items():
            assert torch.equal(torch.as_tensor(val), torch.as_tensor(sb[name])), name


def _assert_same_snapshot(got: ShardSnapshot, expected: ShardSnapshot) -> None:
    assert got.version == expected.version
    assert sorted(got.pieces) == sorted(expected.pieces)
    assert got.scalars == expected.scalars
    for off, entry in expected.pieces.items():
        assert sorted(got.pieces[off]) == sorted(entry)
        for name, t in entry.items():
            assert torch.equal(got.pieces[off][name], t), (off, name)


def _write_in_thread(state: ShardState, root: Path, step: int, **kw: Any) -> tuple[PendingSnapshot, threading.Thread,
                                                                                  threading.Event]:
    """Open a snapshot and write it with `save_shard` on a thread that starts once the event is set."""
    pending = state.open_snapshot(step, **kw)
    go = threading.Event()

    def write() -> None:
        go.wait(30)
        save_shard(root, pending.snapshot)

    thread = threading.Thread(target=write)
    thread.start()
    return pending, thread, go


def _write(pending: PendingSnapshot, offsets: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """What a checkpoint writer does, into memory: each piece of `offsets` read (copied here) and released."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for off in offsets:
        for name in pending.snapshot.pieces[off]:
            out.setdefault(off, {})[name] = pending.take(off, name).clone()
            pending.written(off, name)
    return out


def _read_back(state: ShardState, root: Path, step: int) -> ShardSnapshot:
    meta, tensors = state.read_checkpoint(str(step_dir(root, step)))
    pieces: dict[int, dict[str, torch.Tensor]] = {}
    for idx, c in state.chunks.items():
        key = chunk_key(idx)
        pieces[c.flat_offset] = {"param": tensors[key], **{n.split("/", 1)[1]: t for n, t in tensors.items()
                                                           if n.startswith(f"{key}/")}}
    scalars: dict[int, dict[str, float]] = {}
    for k, v in meta.scalars.items():
        idx, name = k.split("/", 1)
        scalars.setdefault(state.chunks[int(idx)].flat_offset, {})[name] = v
    return ShardSnapshot(experiment="", step=step, shard=0, num_shards=1, total_numel=0,
                         version=meta.state_version, pieces=pieces, scalars=scalars)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_updates_during_a_snapshot_copy_nothing_and_keep_the_bits_of_in_place_updates(name: str) -> None:
    reference, state = _state(OPTIMIZERS[name]), _state(OPTIMIZERS[name])
    for s in (reference, state):
        for seed in range(3):  # optimizer state exists (momentum, AdamW's moments and step)
            s.step(_grads(s, seed), 1.0, schedule=False)
    expected = state.snapshot(9)  # the copying snapshot of this version
    pending = state.open_snapshot(9)
    order = list(pending.snapshot.pieces)
    assert order == sorted(order, reverse=True)  # the writer starts from the last chunk
    first = order[0]
    held = {off: storage_of(pending.take(off, "param")) for off in order}
    assert held == {c.flat_offset: storage_of(state.params[i]) for i, c in state.chunks.items()}  # no copy
    written = _write(pending, [first])  # the writer wrote the last chunk before the updates came
    for seed in range(3, 6):  # updates keep landing while the snapshot is pending
        reference.step(_grads(reference, seed), 0.5, schedule=False)
        state.step(_grads(state, seed), 0.5, schedule=False)
    _assert_same_state(reference, state)  # out of place, the same arithmetic: the same bits
    assert pending.serve_copies == 0 and pending.finish_seconds == 0.0  # the serve thread copied nothing
    per_chunk = len(pending.snapshot.pieces[first])
    assert pending.pieces_aside == (len(state.chunks) - 1) * per_chunk  # within the budget: written aside
    for off in order[1:]:  # the updates left the storage to the snapshot
        assert storage_of(pending.take(off, "param")) == held[off] != storage_of(
            state.params[next(i for i, c in state.chunks.items() if c.flat_offset == off)])
    written.update(_write(pending, order[1:]))
    assert pending.done
    _assert_same_snapshot(dataclasses.replace(pending.snapshot, pieces=written, stream=None), expected)


def test_a_checkpoint_written_while_updates_land_holds_its_version(tmp_path: Path) -> None:
    reference, state = _state(OPTIMIZERS["momentum"], chunks=40), _state(OPTIMIZERS["momentum"], chunks=40)
    lock = threading.RLock()
    for s in (reference, state):
        s.step(_grads(s, 0), 1.0, schedule=False)
    expected = state.snapshot(4)
    with lock:
        pending, writer, go = _write_in_thread(state, tmp_path, 4)
    go.set()
    seed = 1
    while writer.is_alive() or seed < 4:  # at least 3 updates, interleaved with the writer
        with lock:
            state.step(_grads(state, seed), 1.0, schedule=False)
        reference.step(_grads(reference, seed), 1.0, schedule=False)
        seed += 1
    writer.join(timeout=30)
    assert pending.done and pending.serve_copies == 0
    _assert_same_snapshot(_read_back(state, tmp_path, 4), expected)
    _assert_same_state(reference, state)
    # Once the snapshot is written, writes are in place again.
    ptrs = [storage_of(p) for p in state.params.values()]
    state.step(_grads(state, seed), 1.0, schedule=False)
    assert [storage_of(p) for p in state.params.values()] == ptrs


def test_an_update_past_the_budget_waits_for_the_writer_and_writes_in_place(tmp_path: Path) -> None:
    reference, state = _state(OPTIMIZERS["momentum"], chunks=20), _state(OPTIMIZERS["momentum"], chunks=20)
    for s in (reference, state):
        s.step(_grads(s, 0), 1.0, schedule=False)
    expected = state.snapshot(2)
    piece = 4 * state.chunks[0].numel
    pending, writer, go = _write_in_thread(state, tmp_path, 2, aside_bytes=2 * piece)
    ptrs = {i: storage_of(p) for i, p in state.params.items()}
    momenta = {i: storage_of(state.optimizer.state[p]["momentum_buffer"]) for i, p in state.params.items()}
    go.set()  # the writer starts from the last chunk, the update from the first: it must wait for it
    state.step(_grads(state, 1), 1.0, schedule=False)
    reference.step(_grads(reference, 1), 1.0, schedule=False)
    writer.join(timeout=30)
    _assert_same_state(reference, state)
    assert pending.aside <= 2 * piece and pending.pieces_aside == 2  # the first chunk's two, within the budget
    assert pending.wait_seconds > 0 and pending.finish_seconds >= pending.wait_seconds
    moved = [i for i, p in state.params.items() if storage_of(p) != ptrs[i]]
    moved += [i for i, p in state.params.items() if storage_of(state.optimizer.state[p]["momentum_buffer"]) != momenta[i]]
    assert moved == [0, 0]  # every other chunk stepped in place, after the writer had written it
    _assert_same_snapshot(_read_back(state, tmp_path, 2), expected)


def test_a_writer_that_does_not_write_costs_at_most_its_wait_then_writes_go_aside() -> None:
    reference, state = _state(OPTIMIZERS["momentum"]), _state(OPTIMIZERS["momentum"])
    for s in (reference, state):
        s.step(_grads(s, 0), 1.0, schedule=False)
    expected = state.snapshot(3)
    pending = state.open_snapshot(3, aside_bytes=0, wait_s=0.2)  # handed to a writer that is stuck
    for seed in (1, 2):
        state.step(_grads(state, seed), 1.0, schedule=False)
        reference.step(_grads(reference, seed), 1.0, schedule=False)
    # The wait is bounded over the snapshot, not per piece: one write waited its 0.2 s, the rest went aside.
    assert pending.waits == 1 and pending.wait_seconds > 0.1
    assert pending.pieces_aside == 2 * len(state.chunks)  # everything went aside once the wait was spent
    _assert_same_state(reference, state)
    _assert_same_snapshot(pending.read_all(), expected)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_torch_optimizers_step_out_of_place_with_the_same_bits(name: str, foreach: bool) -> None:
    def build() -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        gen = torch.Generator().manual_seed(1)
        params = [torch.randn(300, generator=gen) for _ in range(4)]
        if name == "sgd":
            return params, torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                           foreach=foreach)
        return params, torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=foreach)

    (ref, ref_opt), (params, opt) = build(), build()
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        for p, q in zip(ref, params, strict=True):
            p.grad = torch.randn(300, generator=gen)
            q.grad = p.grad.clone()
        ref_opt.step()
        frozen_values = [p.detach() for p in params[:2]]  # half of them read elsewhere
        before = [t.clone() for t in frozen_values]
        mode = WritesAside({storage_of(t) for t in frozen_values})
        with mode:
            opt.step()
        assert mode.copies == 0 and mode.moved >= 2
        for t, b in zip(frozen_values, before, strict=True):
            assert torch.equal(t, b)  # untouched
        for p, q in zip(ref, params, strict=True):
            assert torch.equal(p, q)


def test_the_shard_hands_its_snapshot_over_and_writes_in_place_once_it_is_written() -> None:
    from gossamer.paramserver import ShardServer

    state = _state(OPTIMIZERS["momentum"])
    config = ShardConfig(experiment="cow", shard=0, mode="async", staleness=None, optimizer=OPTIMIZERS["momentum"],
                         total_steps=1000)
    server = ShardServer(config, state.plan, {i: p.clone() for i, p in state.params.items()}, own_init=True)
    try:
        got: list[ShardSnapshot] = []
        with server._lock:  # noqa: SLF001 — snapshot_later runs on the serve thread, under the lock
            pending = server.snapshot_later(1, got.append)
        assert len(got) == 1 and got[0] is pending.snapshot and got[0].stream is pending
        assert all(t.device.type == "meta" for entry in got[0].pieces.values() for t in entry.values())  # no copy
        pending.read_all()  # what a checkpointer does
        assert pending.done and server.stats()["snapshot_chunks_copied"] == len(state.chunks)
        # A writer that refuses it (a save still running): the snapshot is closed at once.
        with server._lock:  # noqa: SLF001
            refused = server.snapshot_later(2, lambda snap: False)
        assert refused.done
    finally:
        server.close()


def test_a_save_that_fails_releases_the_snapshot(tmp_path: Path) -> None:
    state = _state(OPTIMIZERS["momentum"])
    state.step(_grads(state, 0), 1.0, schedule=False)
    pending = state.open_snapshot(5, aside_bytes=0)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(OSError):
        save_shard(blocker, pending.snapshot)  # its step directory cannot be made
    assert pending.done  # nothing stays frozen for a save that ended
    ptrs = [storage_of(p) for p in state.params.values()]
    state.step(_grads(state, 1), 1.0, schedule=False)
    assert pending.waits == 0  # no wait for a writer that is gone
    assert [storage_of(p) for p in state.params.values()] == ptrs  # in place


def test_updates_are_held_back_while_the_writer_is_behind_for_at_most_defer_s() -> None:
    """`holds_back`: an update now would wait for the writer (more is unwritten than the room left aside), so
    the serve loop keeps it back; not once the writer is close enough, nor past `defer_s` of a stuck writer."""
    state = _state(OPTIMIZERS["momentum"], chunks=20)
    state.step(_grads(state, 0), 1.0, schedule=False)
    piece = 4 * state.chunks[0].numel
    pending = state.open_snapshot(2, aside_bytes=4 * piece, defer_s=5.0)
    assert state.holds_back(100.0)  # 40 pieces (values and momentum of 20 chunks) unwritten, room for 4
    offsets = list(pending.snapshot.pieces)  # the writer's order
    for offset in offsets[:-2]:
        for name in pending.snapshot.pieces[offset]:
            pending.take(offset, name)
            pending.written(offset, name)
    assert not state.holds_back(101.0)  # 4 pieces left: an update writes them aside
    state.step(_grads(state, 1), 1.0, schedule=False)
    assert pending.wait_seconds == 0 and pending.pieces_aside == 4
    pending.close()
    stuck = state.open_snapshot(3, aside_bytes=0, defer_s=5.0)
    assert not stuck.done
    assert state.holds_back(200.0) and state.holds_back(204.9)  # counted from the first time it held back
    assert not state.holds_back(205.0)
    stuck.close()
    assert not state.holds_back(205.0)
