"""The copies a DiLoCo worker does not make: a whole gradient, a pseudo-gradient over the exchange, a round start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from gossamer.core.experiment import Experiment
from gossamer.engine.layout import NodeLayout, ReplicatedLayout, make_layout
from gossamer.engine.rank import RankContext
from gossamer.paramserver import ShardClient, ShardPlan
from gossamer.paramserver.local import LocalShards
from gossamer.training.diloco.diloco_trainer import DilocoTrainer
from gossamer.training.diloco.step_in_backward import StepInBackward
from gossamer.training.local_optimizer import inner_optimizer
from gossamer.training.shards import ps_trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DIGITS = dict(model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data")


class NewStorageBytes(TorchDispatchMode):
    """Counts the bytes of every storage a torch op creates (in-place ops and views create none)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        made = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given}
        self.bytes += sum(made.values())
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _layout(parallelism: str) -> NodeLayout:
    exp = Experiment(name="m", mode="diloco", parallelism=parallelism, chunk_numel=100, **DIGITS)  # type: ignore[arg-type]
    model = _model()
    layout = make_layout(model, exp, 0, 1, torch.device("cpu"))
    layout.use_plan(ShardPlan.for_experiment(model, exp))
    return layout


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 16, generator=g), torch.randint(0, 8, (12,), generator=g)


def _backward(layout: NodeLayout) -> None:
    layout.node_gradient(_batch(), 12, 12, 1.0, before_reduce=lambda: None)
    layout.gradient_ready()


def test_a_released_gradient_comes_back_zeroed_as_views_of_one_flat_buffer() -> None:
    kept, released = _layout("ddp"), _layout("ddp")
    assert isinstance(kept, ReplicatedLayout) and isinstance(released, ReplicatedLayout)
    for layout in (kept, released):
        _backward(layout)
    released.release_gradients()
    assert released.flat_grad is None and all(p.grad is None for p in released.module.parameters())
    with NewStorageBytes() as alloc:
        released.params_changed()  # the parameters are still views of `flat`: nothing to copy
        released.params_stepped()
    assert alloc.bytes == 0
    for layout in (kept, released):
        _backward(layout)
    assert released.flat_grad is not None and kept.flat_grad is not None
    assert torch.equal(released.flat_grad, kept.flat_grad)  # zeroed before backward, as if never released
    base = released.flat_grad.untyped_storage().data_ptr()
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == base
               for p in released.module.parameters())
    flat = released.flat.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == flat for p in released.module.parameters())


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_the_pseudo_gradient_is_taken_in_the_round_start_buffer(parallelism: str) -> None:
    layout = _layout(parallelism)
    start = layout.snapshot()
    with torch.no_grad():
        for p in layout.module.parameters():
            p.add_(0.5)
    with NewStorageBytes() as alloc:
        delta = layout.chunk_delta(start)
    assert alloc.bytes == 0, f"chunk_delta made {alloc.bytes} bytes of copies"
    starts = {t.untyped_storage().data_ptr() for t in (start.values() if isinstance(start, dict) else [start])}
    assert {d.untyped_storage().data_ptr() for d in delta.values()} <= starts
    for d in delta.values():  # theta_0 - theta_H
        torch.testing.assert_close(d, torch.full_like(d, -0.5), rtol=0, atol=1e-6)


def _trainer(exp: Experiment, shards: LocalShards, tmp_path: Path) -> DilocoTrainer:
    """Worker 0 of 1 of `exp` on `shards`."""
    return DilocoTrainer(RankContext(experiment_id="e", experiment=exp, node_id="n", worker_index=0, num_workers=1,
                                     endpoints=shards.endpoints, checkpoint_dir=str(tmp_path)))


def test_a_diloco_worker_pushes_without_a_gradient_from_round_start_buffers_that_become_the_residual(
        tmp_path: Path) -> None:
    """The round start (residual folded in) and the residual together are one model's bytes at every inner step and
    over every push's round trip (apart, they were two); the push is one shard's at a time; after the first round,
    folding allocates nothing and each pushed buffer is kept as its chunk's residual."""
    torch.set_num_threads(1)
    exp = Experiment(name="d", mode="diloco", num_ps_shards=2, inner_steps=2, total_steps=6, eval_every=0,
                     lr=0.003, seed=1, **DIGITS)  # type: ignore[arg-type]
    shards = LocalShards(exp)
    try:
        trainer = _trainer(exp, shards, tmp_path)
        layout, comp, start = trainer.layout, trainer.client.compressor, trainer.start
        assert isinstance(layout, ReplicatedLayout) and comp is not None and start is not None
        model_bytes = 4 * layout.total_numel

        def held_bytes() -> int:  # the round start and the residuals, each storage once
            tensors = [*start.buffers.values(), *(r for i in range(len(trainer.plan.chunks))
                                                  if (r := comp.feedback.residual(f"c{i}")) is not None)]
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

        seen: list[tuple[bool, set[int], int, set[int]]] = []
        held: list[int] = []
        push_pull = trainer.client.push_pull

        def spy(grads: dict[int, torch.Tensor], **kw: Any) -> Any:
            no_grad = layout.flat_grad is None and all(p.grad is None for p in trainer.model.parameters())
            storages = {i: g.untyped_storage().data_ptr() for i, g in grads.items()}
            out = push_pull(grads, **kw)
            kept = all(comp.feedback.residual(f"c{i}").untyped_storage().data_ptr() == p  # type: ignore[union-attr]
                       for i, p in storages.items())
            seen.append((no_grad and kept, set(storages.values()), layout.flat.untyped_storage().data_ptr(),
                         {trainer.plan.chunks[i].shard for i in storages}))
            return out

        def on_wait() -> None:  # polled while a reply is awaited
            held.append(held_bytes())
            on_wait_before()

        on_wait_before = trainer.client.on_wait
        assert on_wait_before is not None
        trainer.client.on_wait = on_wait
        trainer.client.push_pull = spy  # type: ignore[method-assign]
        grads_held: list[int] = []
        step = trainer.inner.step

        def counting_step(*a: Any, **k: Any) -> Any:
            grads_held.append(sum(p.grad is not None for p in trainer.model.parameters()))
            held.append(held_bytes())
            return step(*a, **k)

        trainer.inner.step = counting_step  # type: ignore[method-assign]
        folded: list[int] = []
        begin = start.begin

        def counting_begin(n: int) -> None:
            with NewStorageBytes() as alloc:
                begin(n)
            folded.append(alloc.bytes)

        start.begin = counting_begin  # type: ignore[method-assign]
        trainer.run()
    finally:
        shards.close()
    assert trainer.rounds == 3 and len(seen) == 6, (trainer.rounds, len(seen))
    for ok, storages, flat, to in seen:
        assert ok, "a gradient was held at the push, or the pushed buffer was not kept as the residual"
        assert flat not in storages and len(to) == 1
    assert held and max(held) <= model_bytes, f"round start and residual held {max(held) / model_bytes:.2f}x"
    assert folded == [model_bytes, 0, 0], folded  # the first round copies theta_0; later ones fold in place
    assert len(grads_held) == 6 * 6 and set(grads_held) == {1}, grads_held


class _WithUnused(nn.Module):
    """An MLP and a parameter no forward reaches (a flat gradient buffer gives it zeros: it is still stepped)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_stepping_inside_backward_is_exactly_stepping_after_it_and_holds_one_gradient(optimizer: str) -> None:
    extra = {"weight_decay": 0.1} if optimizer == "adamw" else {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}
    exp = Experiment(name="m", mode="diloco", optimizer=optimizer, chunk_numel=100, **extra, **DIGITS)  # type: ignore[arg-type]
    layouts: list[ReplicatedLayout] = []
    for _ in range(2):
        torch.manual_seed(0)
        layout = make_layout(_WithUnused(), exp, 0, 1, torch.device("cpu"))
        assert isinstance(layout, ReplicatedLayout)
        layouts.append(layout)
    after, inside = layouts
    opt_after = inner_optimizer(exp, after.module.parameters())
    opt_inside = inner_optimizer(exp, inside.module.parameters())
    inside.step_in_backward()
    stepper = StepInBackward(opt_inside, inside.module)
    held: list[int] = []
    step = opt_inside.step

    def counting_step(*a: Any, **k: Any) -> Any:
        held.append(sum(p.grad is not None for p in inside.module.parameters()))
        return step(*a, **k)

    opt_inside.step = counting_step  # type: ignore[method-assign]
    for _ in range(3):
        _backward(after)
        opt_after.step()
        with stepper.armed():
            _backward(inside)
        assert inside.flat_grad is None and all(p.grad is None for p in inside.module.parameters())
    assert torch.equal(after.flat, inside.flat)  # bitwise: the same arithmetic, tensor by tensor
    assert not torch.equal(after.module.unused, torch.ones(5))  # the zero-gradient step reached it
    assert held == [1] * len(held) and len(held) == 3 * 5, held  # 4 reached by backward + the unused one, each alone


def _run_diloco(tmp_path: Path, lead: bool = False, **fields: Any) -> tuple[DilocoTrainer, list[set[int]]]:
    """One worker, three rounds on two in-process shards; the chunk indices of every push (`lead`: it finishes)."""
    torch.set_num_threads(1)
    exp = Experiment(name="s", mode="diloco", num_ps_shards=2, inner_steps=2, total_steps=6, eval_every=0,
                     lr=0.003, seed=1, chunk_numel=2000, **fields, **DIGITS)  # type: ignore[arg-type]
    shards = LocalShards(exp)
    try:
        trainer = DilocoTrainer(RankContext(experiment_id="e", experiment=exp, node_id="n", worker_index=0,
                                            num_workers=1, endpoints=shards.endpoints, lead=lead,
                                            checkpoint_dir=str(tmp_path)))
        pushed: list[set[int]] = []
        push_pull = trainer.client.push_pull

        def spy(grads: dict[int, torch.Tensor], **kw: Any) -> Any:
            pushed.append(set(grads))
            return push_pull(grads, **kw)

        trainer.client.push_pull = spy  # type: ignore[method-assign]
        trainer.run()
    finally:
        shards.close()
    return trainer, pushed


def test_round_start_from_the_shards_trains_exactly_as_a_kept_copy_one_shard_at_a_time(tmp_path: Path) -> None:
    kept, kept_pushes = _run_diloco(tmp_path / "m")
    pulled, pulled_pushes = _run_diloco(tmp_path / "s", round_start="shards")
    assert kept.rounds == pulled.rounds == 3
    assert torch.equal(kept.layout.flat, pulled.layout.flat)  # bitwise: the same pseudo-gradients, pushed alike
    plan = pulled.plan
    assert kept_pushes == pulled_pushes and len(pulled_pushes) == 6
    assert all(len({plan.chunks[i].shard for i in p}) == 1 for p in pulled_pushes)
    assert pulled.client.bytes_down > kept.client.bytes_down  # the round's start is downloaded again


def test_clipping_falls_back_to_a_step_after_backward_and_trains_as_stepping_inside(tmp_path: Path) -> None:
    inside, _ = _run_diloco(tmp_path / "i")
    unclipped, _ = _run_diloco(tmp_path / "u", max_grad_norm=1e9)  # the whole-gradient path; its norm never reaches it
    clipped, _ = _run_diloco(tmp_path / "c", max_grad_norm=1e-3)
    assert inside.stepper is not None and unclipped.stepper is None and clipped.stepper is None
    assert torch.equal(inside.layout.flat, unclipped.layout.flat)  # bitwise: inside backward is the same step
    assert not torch.equal(clipped.layout.flat, unclipped.layout.flat)  # the clip was applied, not stepped past
    assert 0 < clipped.grad_norm < 1e9


def test_the_lead_frees_the_inner_state_and_residual_before_its_final_pull_and_checkpoint(tmp_path: Path) -> None:
    held: list[tuple[int, int]] = []  # (inner optimizer states, error-feedback residuals) at each pull
    pull = DilocoTrainer.pull

    def spy(self: DilocoTrainer) -> bool:
        assert self.client.compressor is not None
        held.append((len(self.inner.state), len(self.client.compressor.feedback)))
        return pull(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DilocoTrainer, "pull", spy)
        trainer, pushes = _run_diloco(tmp_path, lead=True)
    assert len(pushes) == 6 and trainer.final_path and Path(trainer.final_path).exists()
    assert held[-1] == (0, 0), f"the final pull came on top of the training state: {held}"
    assert held[0] == (0, 0) and len(held) == 2  # the first pull, before any step; then the final one


def test_an_outer_push_is_acknowledged_and_its_shard_pulled_a_group_at_a_time_after_it(tmp_path: Path) -> None:
    """No reply carries a shard's values beside the encoded push: each push's answer holds none, and the shard's
    new values come after it in groups of at most `PULL_GROUP_BYTES`, before the next shard's push. The values
    written are the same, bit for bit, as pulled in one group a shard."""
    events: list[tuple[str, int, int]] = []  # (push | pull, shard, value bytes of the answer)
    push_pull, pull = ShardClient.push_pull, ShardClient.pull

    def spy_push(self: ShardClient, grads: dict[int, torch.Tensor], **kw: Any) -> Any:
        shard = {self.plan.chunks[i].shard for i in grads}.pop()
        res = push_pull(self, grads, **kw)
        events.append(("push", shard, sum(4 * v.numel() for v in res.values.values())))
        return res

    def spy_pull(self: ShardClient, shards: Any = None, timeout_s: float | None = None, chunks: Any = None) -> Any:
        res = pull(self, shards, timeout_s, chunks)
        if chunks is not None:
            events.append(("pull", {self.plan.chunks[i].shard for i in res.values}.pop(),
                           sum(4 * v.numel() for v in res.values.values())))
        return res

    group = 2 * 4 * 2000  # two chunks of `_run_diloco`'s
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ShardClient, "push_pull", spy_push)
        mp.setattr(ShardClient, "pull", spy_pull)
        mp.setattr(ps_trainer, "PULL_GROUP_BYTES", 1 << 30)
        whole, _ = _run_diloco(tmp_path / "w")
        events.clear()
        mp.setattr(ps_trainer, "PULL_GROUP_BYTES", group)
        grouped, pushes = _run_diloco(tmp_path / "g")
    assert grouped.rounds == 3 and len(pushes) == 6
    assert torch.equal(whole.layout.flat, grouped.layout.flat)
    shard_bytes = {s: 4 * sum(c.numel for c in grouped.plan.chunks_of_shard(s)) for s in (0, 1)}
    assert all(b > group for b in shard_bytes.values())
    pushed = [i for i, e in enumerate(events) if e[0] == "push"]
    assert len(pushed) == 6 and all(events[i][2] == 0 for i in pushed), events  # acknowledged, no values
    for i, start in enumerate(pushed):  # after each push, its shard's values in groups, then the next push
        after = events[start + 1 : pushed[i + 1] if i + 1 < len(pushed) else len(events)]
        assert {e[1] for e in after} == {events[start][1]} and len(after) > 1
        assert all(0 < e[2] <= group for e in after), after
        assert sum(e[2] for e in after) == shard_bytes[events[start][1]]


class LargestNewStorage(TorchDispatchMode):
    """The largest storage a torch op creates (in-place ops and views create none)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_a_large_adamw_parameter_is_stepped_a_slice_at_a_time_to_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `SLICE_NUMEL` values an AdamW parameter stepped inside backward makes its temporaries (the
    denominator) a slice's size, not the parameter's; the parameters and the state end bit for bit where one
    whole `opt.step()` after backward puts them, from the first step (the state made lazily) on."""
    from gossamer.training.diloco import step_in_backward

    slice_numel = 64
    monkeypatch.setattr(step_in_backward, "SLICE_NUMEL", slice_numel)
    exp = Experiment(name="m", mode="diloco", optimizer="adamw", weight_decay=0.1, chunk_numel=100,
                     **DIGITS)  # type: ignore[arg-type]
    layouts: list[ReplicatedLayout] = []
    for _ in range(2):
        torch.manual_seed(0)
        layout = make_layout(_model(), exp, 0, 1, torch.device("cpu"))
        assert isinstance(layout, ReplicatedLayout)
        layouts.append(layout)
    after, inside = layouts
    opt_after = inner_optimizer(exp, after.module.parameters())
    opt_inside = inner_optimizer(exp, inside.module.parameters())
    inside.step_in_backward()
    stepper = StepInBackward(opt_inside, inside.module)
    largest: list[int] = []
    step_sliced = stepper._step_sliced

    def measured(p: torch.Tensor) -> None:
        with LargestNewStorage() as mode:
            step_sliced(p)
        largest.append(mode.largest)

    monkeypatch.setattr(stepper, "_step_sliced", measured)
    for _ in range(3):
        _backward(after)
        opt_after.step()
        with stepper.armed():
            _backward(inside)
    assert len(largest) == 3 * 2, largest  # the two weights (512 and 256 values) are sliced; the biases are not
    weights = sorted(4 * p.numel() for p in inside.module.parameters() if p.numel() > slice_numel)
    assert sorted(largest[:2]) == weights, largest  # the first step makes the state (zeros), whole
    assert max(largest[2:]) <= 4 * slice_numel, largest  # then nothing larger than a slice
    assert torch.equal(after.flat, inside.flat)
    for pa, pi in zip(after.module.parameters(), inside.module.parameters(), strict=True):
        sa, si = opt_after.state[pa], opt_inside.state[pi]
        assert sorted(sa) == sorted(si) and all(torch.equal(sa[k], si[k]) for k in sa), (sa.keys(), si.keys())
