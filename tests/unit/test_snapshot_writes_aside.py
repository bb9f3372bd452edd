"""A checkpoint snapshot costs serving no copy: updates write what it holds out of place, with the same bits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gossamer.checkpoint.sharded import ShardSnapshot
from gossamer.paramserver import OptimizerConfig, ShardConfig, ShardPlan
from gossamer.paramserver._copy_on_write import WritesAside, storage_of
from gossamer.paramserver._snapshot import copy_in_background
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


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_updates_during_a_snapshot_copy_nothing_and_keep_the_bits_of_in_place_updates(name: str) -> None:
    reference, state = _state(OPTIMIZERS[name]), _state(OPTIMIZERS[name])
    for s in (reference, state):
        for seed in range(3):  # optimizer state exists (momentum, AdamW's moments and step)
            s.step(_grads(s, seed), 1.0, schedule=False)
    expected = state.snapshot(9)  # the copying snapshot of this version
    pending = state.open_snapshot(9)
    held = {c.flat_offset: storage_of(state.params[i]) for i, c in state.chunks.items()}
    assert pending.copy_next()  # the copier took one chunk before the update came
    for seed in range(3, 6):  # updates keep landing while the snapshot is pending
        reference.step(_grads(reference, seed), 0.5, schedule=False)
        state.step(_grads(state, seed), 0.5, schedule=False)
    _assert_same_state(reference, state)  # out of place, the same arithmetic: the same bits
    assert pending.done
    assert pending.serve_copies == 0 and pending.finish_seconds == 0.0  # the serve thread copied nothing
    assert pending.copied == 1 and pending.adopted == len(state.chunks) - 1
    _assert_same_snapshot(pending.snapshot, expected)
    for off, entry in pending.snapshot.pieces.items():  # the update left its storage to the snapshot
        if off != max(held):  # the copier's first: the last chunk
            assert storage_of(entry["param"]) == held[off]


def test_the_snapshot_stays_at_its_version_while_the_copier_races_updates() -> None:
    reference, state = _state(OPTIMIZERS["momentum"], chunks=40), _state(OPTIMIZERS["momentum"], chunks=40)
    lock = threading.RLock()
    for s in (reference, state):
        s.step(_grads(s, 0), 1.0, schedule=False)
    expected = state.snapshot(4)
    got: list[ShardSnapshot] = []
    with lock:
        pending = state.open_snapshot(4)
        copier = threading.Thread(target=copy_in_background, args=(pending, lock, got.append))
        copier.start()
    seed = 1
    while copier.is_alive() or seed < 4:  # at least 3 updates, interleaved with the copier's hand-overs
        with lock:
            state.step(_grads(state, seed), 1.0, schedule=False)
        reference.step(_grads(reference, seed), 1.0, schedule=False)
        seed += 1
    copier.join(timeout=30)
    assert len(got) == 1 and got[0] is pending.snapshot
    assert pending.serve_copies == 0 and pending.finish_seconds == 0.0
    assert pending.copied + pending.adopted == len(state.chunks)
    _assert_same_snapshot(got[0], expected)
    _assert_same_state(reference, state)
    # Once the snapshot is whole, writes are in place again.
    ptrs = [storage_of(p) for p in state.params.values()]
    state.step(_grads(state, seed), 1.0, schedule=False)
    assert [storage_of(p) for p in state.params.values()] == ptrs


def test_an_update_takes_the_copiers_published_copies_and_writes_in_place() -> None:
    reference, state = _state(OPTIMIZERS["momentum"]), _state(OPTIMIZERS["momentum"])
    for s in (reference, state):
        s.step(_grads(s, 0), 1.0, schedule=False)
    expected = state.snapshot(2)
    lock = threading.RLock()
    got: list[ShardSnapshot] = []
    with lock:  # the serve thread holds the lock: the copier copies and publishes, but cannot hand over
        pending = state.open_snapshot(2)
        copier = threading.Thread(target=copy_in_background, args=(pending, lock, got.append))
        copier.start()
        deadline = time.monotonic() + 60
        while pending.published < len(state.chunks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pending.published == len(state.chunks)
        ptrs = [storage_of(p) for p in state.params.values()]
        state.step(_grads(state, 1), 1.0, schedule=False)
        assert [storage_of(p) for p in state.params.values()] == ptrs  # in place: the copies were ready
        assert pending.copied == len(state.chunks) and pending.adopted == 0 and pending.serve_copies == 0
    copier.join(timeout=30)
    reference.step(_grads(reference, 1), 1.0, schedule=False)
    _assert_same_state(reference, state)
    assert len(got) == 1
    _assert_same_snapshot(got[0], expected)


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


def test_the_shard_keeps_no_snapshot_once_it_is_handed_over() -> None:
    import gc
    import weakref

    from gossamer.paramserver import ShardServer

    state = _state(OPTIMIZERS["momentum"])
    config = ShardConfig(experiment="cow", shard=0, mode="async", staleness=None, optimizer=OPTIMIZERS["momentum"],
                         total_steps=1000)
    server = ShardServer(config, state.plan, {i: p.clone() for i, p in state.params.items()}, own_init=True)
    try:
        got: list[ShardSnapshot] = []
        with server._lock:  # noqa: SLF001 — snapshot_later runs on the serve thread, under the lock
            copier = server.snapshot_later(1, got.append)
        copier.join(timeout=30)
        assert len(got) == 1 and server.stats()["snapshot_chunks_copied"] == len(state.chunks)
        piece = weakref.ref(next(iter(got[0].pieces.values()))["param"])
        got.clear()  # the checkpointer is done with it
        gc.collect()
        assert piece() is None  # freed where the checkpointer let go, not kept until the next checkpoint
    finally:
        server.close()
