"""DiLoCo's round start with the error-feedback residual folded in: the same training, a refused push, a stop."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gossamer.core.errors import ShardError
from gossamer.core.experiment import Experiment
from gossamer.engine.rank import RankContext
from gossamer.paramserver.local import LocalShards
from gossamer.training.diloco.diloco_trainer import DilocoTrainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DIGITS = dict(model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data")

Spy = Callable[[DilocoTrainer, LocalShards, Callable[..., Any], dict[int, torch.Tensor], dict[str, Any]], Any]


def _train(tmp_path: Path, *, folded: bool = True, spy: Spy | None = None,
           should_stop: Callable[[], bool] | None = None, **fields: Any) -> tuple[DilocoTrainer, torch.Tensor]:
    """One worker, three rounds of int8 pushes on two in-process shards (`folded=False`: the round start and the
    residual apart, as several local ranks run it); its final parameters. `spy` wraps every push."""
    torch.set_num_threads(1)
    exp = Experiment(name="f", mode="diloco", num_ps_shards=2, inner_steps=2, total_steps=6, eval_every=0,
                     lr=0.003, seed=1, chunk_numel=2000, **fields, **DIGITS)  # type: ignore[arg-type]
    shards = LocalShards(exp)
    try:
        trainer = DilocoTrainer(RankContext(experiment_id="e", experiment=exp, node_id="n", worker_index=0,
                                            num_workers=1, endpoints=shards.endpoints, checkpoint_dir=str(tmp_path)),
                                should_stop=should_stop)
        assert trainer.start is not None
        if not folded:
            trainer.start = None
        if spy is not None:
            push_pull = trainer.client.push_pull

            def spying(grads: dict[int, torch.Tensor], **kw: Any) -> Any:
                assert spy is not None
                return spy(trainer, shards, push_pull, grads, kw)

            trainer.client.push_pull = spying  # type: ignore[method-assign]
        trainer.run()
    finally:
        shards.close()
    return trainer, trainer.layout.flat.clone()


def _same_to_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to 1e-6 but for the few entries that fp32 rounding moved across an int8 quantization boundary (one
    step apart; the residual carries that step to the next round): at most 1 in 2,000 here, where dropping the
    residual moves three in four."""
    off = (a - b).abs() > 1e-6
    assert float(off.float().mean()) < 5e-4, f"{int(off.sum())} of {a.numel()} entries differ"


def test_the_folded_round_start_trains_as_the_residual_kept_apart(tmp_path: Path) -> None:
    folded, a = _train(tmp_path / "f")
    apart, b = _train(tmp_path / "a", folded=False)
    _, off = _train(tmp_path / "o", error_feedback="off")
    assert folded.rounds == apart.rounds == 3
    assert folded.client.compressor is not None and len(folded.client.compressor.feedback) > 0
    _same_to_rounding(a, b)
    assert float(((b - off).abs() > 1e-6).float().mean()) > 0.5  # the residual matters at that tolerance


def _refuse_once(shard: int, at_push: int) -> tuple[Spy, dict[str, Any]]:
    """A spy making `shard` (and, pushing to several, every shard) re-form its barrier before push `at_push`:
    a real refusal by the real shard (REFORM); the worker then hears of the new generation."""
    seen: dict[str, Any] = {"pushes": 0, "refused": None, "redo": None, "before": None, "after": None}

    def spy(trainer: DilocoTrainer, shards: LocalShards, push_pull: Callable[..., Any],
            grads: dict[int, torch.Tensor], kw: dict[str, Any]) -> Any:
        seen["pushes"] += 1
        comp = trainer.client.compressor
        assert comp is not None
        targets = {trainer.plan.chunks[i].shard for i in grads}
        if seen["pushes"] == at_push:
            assert shard in targets
            seen["refused"] = {i: g.clone() for i, g in grads.items()}
            seen["before"] = {i: r.clone() for i in grads if (r := comp.feedback.residual(f"c{i}")) is not None}
            for s in targets:
                srv = shards.servers[s]
                srv.post(lambda srv=srv: srv.set_members(["n:0"], 1))
                deadline = time.monotonic() + 30
                while trainer.client.stats(s)["generation"] != 1:
                    assert time.monotonic() < deadline, "the shard did not re-form its barrier"
                    time.sleep(0.01)
            try:
                push_pull(grads, **kw)
            except ShardError as e:
                assert "REFORM" in e.codes, e
                trainer.ctx.generation = 1
                raise
            raise AssertionError("the re-formed barrier took the push")
        if seen["refused"] is not None and seen["redo"] is None:  # the residuals as the refusal left them
            seen["redo"] = {i: g.clone() for i, g in grads.items()}
            seen["after"] = {i: r.clone() for i in seen["refused"] if (r := comp.feedback.residual(f"c{i}")) is not None}
        return push_pull(grads, **kw)

    return spy, seen


def test_a_refused_folded_push_is_pushed_again_as_it_was(tmp_path: Path) -> None:
    """Round 2, shard 1 refuses (shard 0 took its part): the buffers of shard 1's chunks are rebuilt from the residual
    and the refused payload, and the redo pushes the same compensated pseudo-gradient; training ends as unrefused."""
    spy, seen = _refuse_once(shard=1, at_push=4)
    trainer, refused = _train(tmp_path / "r", spy=spy)
    _, plain = _train(tmp_path / "p")
    assert trainer.redone == 1 and trainer.rounds == 3 and seen["pushes"] == 7
    assert not seen["after"], "the refused push's residual was kept"
    assert seen["redo"].keys() == seen["refused"].keys()
    for i, g in seen["refused"].items():  # fp32 rounding of (b - theta_H) + theta_H only
        torch.testing.assert_close(seen["redo"][i], g, rtol=0, atol=1e-6)
    _same_to_rounding(refused, plain)


def test_a_refused_push_gives_the_residual_back_when_kept_apart(tmp_path: Path) -> None:
    """Main kept the residual of the refused encoding, dropping the one before it; now it goes back to that."""
    spy, seen = _refuse_once(shard=1, at_push=2)
    trainer, refused = _train(tmp_path / "r", folded=False, spy=spy)
    _, plain = _train(tmp_path / "p", folded=False)
    assert trainer.redone == 1 and trainer.rounds == 3 and seen["pushes"] == 4
    assert seen["before"] and seen["after"].keys() == seen["before"].keys()
    for i, r in seen["before"].items():
        torch.testing.assert_close(seen["after"][i], r, rtol=0, atol=1e-6)
    for i, g in seen["refused"].items():
        assert torch.equal(seen["redo"][i], g)
    _same_to_rounding(refused, plain)


@pytest.mark.parametrize("round_start", ["memory", "shards"])
def test_a_stop_mid_round_brings_the_round_start_back_exactly(tmp_path: Path, round_start: str) -> None:
    """Stopped in round 2's inner steps: the parameters are the shards' version 1 (theta_0) bit for bit."""
    stop = [False]
    pushes: list[int] = []
    at_stop: list[torch.Tensor] = []

    def spy(trainer: DilocoTrainer, shards: LocalShards, push_pull: Callable[..., Any],
            grads: dict[int, torch.Tensor], kw: dict[str, Any]) -> Any:
        out = push_pull(grads, **kw)
        pushes.append(1)
        if len(pushes) == 2:  # round 1 done: theta_0 of round 2 is the shards' now
            at_stop.append(shards.flat())
            step = trainer.inner.step

            def stepping(*a: Any, **k: Any) -> Any:
                stop[0] = True
                return step(*a, **k)

            trainer.inner.step = stepping  # type: ignore[method-assign]
        return out

    trainer, flat = _train(tmp_path, spy=spy, should_stop=lambda: stop[0], round_start=round_start)
    assert stop[0] and len(pushes) == 2 and trainer.rounds == 1 and not trainer.finished
    assert trainer.version == 1
    assert torch.equal(flat, at_stop[0])


def test_a_folded_encode_keeps_the_residual_in_the_buffer_handed_over_and_take_back_undoes_it() -> None:
    from torch import nn

    from gossamer.compression.chunk_codec import ChunkCompressor
    from gossamer.paramserver import ShardPlan

    exp = Experiment(name="c", mode="diloco", chunk_numel=700, **DIGITS)  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(30, 40), nn.Linear(40, 5))
    plan = ShardPlan.for_experiment(model, exp)
    apart, folded = (ChunkCompressor("int8", plan) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    n = plan.chunks[0].numel
    for step in range(3):
        x = torch.randn(n, generator=g) * 0.01
        e = folded.feedback.take("c0")
        handed = x.clone() if e is None else e.add_(x)  # compensated, in the residual's own buffer
        folded.folded.add(0)
        folded.recorded = {}
        wire_a, _ = apart.encode(0, x)
        wire_f, meta_f = folded.encode(0, handed)
        kept = folded.feedback.residual("c0")
        assert kept is not None and kept.data_ptr() == handed.data_ptr()  # the buffer handed over
        torch.testing.assert_close(kept, apart.feedback.residual("c0"), rtol=0, atol=1e-7)
        assert all(torch.equal(wire_a[k], wire_f[k]) for k in wire_a) or step > 0
    before = kept.clone()
    back = folded.take_back(0, None)  # refused whole: the compensated input comes back, the residual goes
    assert back is not None and back.data_ptr() == kept.data_ptr() and "c0" not in folded.feedback
    torch.testing.assert_close(back, before + folded.decode(0, wire_f, meta_f), rtol=0, atol=0)


def test_a_round_start_refolded_at_another_worker_count_pushes_that_counts_share_and_the_same_residual() -> None:
    from torch import nn

    from gossamer.compression.chunk_codec import ChunkCompressor
    from gossamer.engine.layout import ReplicatedLayout
    from gossamer.paramserver import ShardPlan
    from gossamer.training.diloco.round_start import RoundStart

    exp = Experiment(name="c", mode="diloco", chunk_numel=300, **DIGITS)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    layout = ReplicatedLayout(model, exp, 0, 1, torch.device("cpu"))
    plan = ShardPlan.for_experiment(model, exp)
    layout.use_plan(plan)
    comp = ChunkCompressor("int8", plan)
    chunks = [c.index for c in layout.chunks()]
    residual = {i: torch.randn(plan.chunks[i].numel) * 1e-4 for i in chunks}
    for i, e in residual.items():
        comp.feedback.keep(f"c{i}", e.clone())
    theta0 = {i: v.clone() for i, v in layout.chunk_values().items()}
    rs = RoundStart(layout, comp, keep=True)
    rs.begin(2)  # folded at 2 workers
    assert len(comp.feedback) == 0 and rs.ready(chunks, 2, exact=True) and not rs.ready(chunks, 3, exact=True)
    with torch.no_grad():
        layout.flat.add_(0.01)  # theta_H
    rs.fill({i: v.clone() for i, v in theta0.items()}, 3)  # a worker joined: theta_0 pulled, refolded at 3
    pushed = rs.pseudo_gradient(chunks, 3)
    assert comp.folded == set(chunks) and not rs.buffers
    for i in chunks:
        torch.testing.assert_close(pushed[i], torch.full_like(pushed[i], -0.01 / 3) + residual[i], rtol=0, atol=1e-7)
