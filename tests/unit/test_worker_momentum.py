"""Worker-side momentum (EF-SignSGD with momentum, DGC) and Delayed Nesterov against hand-computed steps."""

from __future__ import annotations

import pytest
import torch

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.compression.momentum_placement import density_warmup_steps, momentum_on_worker
from gossamer.compression.worker_momentum import WorkerMomentum, warmup_density
from gossamer.core.experiment import Experiment
from gossamer.engine.shard_plan import ShardPlan
from gossamer.paramserver.delayed_nesterov import DelayedNesterov
from gossamer.paramserver.optimizer import build_optimizer
from gossamer.paramserver.shard_config import ShardConfig
from gossamer.training.shards.density_warmup import warm_spec

BASE = {"name": "m", "model": "m:f", "dataset": "d:f", "total_steps": 200}


def one_chunk(numel: int) -> ShardPlan:
    return ShardPlan.build([("w", numel)], num_shards=1, chunk_numel=1 << 20)


def test_momentum_and_nesterov_follow_torch_convention() -> None:
    wm = WorkerMomentum(0.9)
    assert wm.step("c0", torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0]
    # u = 0.9 * [1, 2] + [3, -1]
    assert wm.step("c0", torch.tensor([3.0, -1.0])).tolist() == pytest.approx([3.9, 0.8])
    nes = WorkerMomentum(0.9, nesterov=True)
    nes.step("c0", torch.tensor([1.0, 2.0]))
    # g + 0.9 * u with u = [3.9, 0.8]
    assert nes.step("c0", torch.tensor([3.0, -1.0])).tolist() == pytest.approx([6.51, -0.28])


def test_dgc_topk_momentum_correction_and_factor_masking() -> None:
    cc = ChunkCompressor("topk:0.25", one_chunk(4), momentum=WorkerMomentum(0.5))
    # step 1: u = g = [4, 1, -2, 0.5]; v = u; top-1 sends 4 (index 0); v = [0, 1, -2, .5]; u[0] = 0
    tensors, _ = cc.encode(0, torch.tensor([4.0, 1.0, -2.0, 0.5]))
    assert tensors["c0/0/indices"].tolist() == [0] and tensors["c0/0/values"].tolist() == [4.0]
    assert cc.momentum.velocity("c0").tolist() == [0.0, 1.0, -2.0, 0.5]
    assert cc.feedback.residual("c0").tolist() == [0.0, 1.0, -2.0, 0.5]
    # step 2: g = [1, 1, 1, 1]; u = 0.5 * [0, 1, -2, .5] + 1 = [1, 1.5, 0, 1.25];
    # v = [0, 1, -2, .5] + u = [1, 2.5, -2, 1.75]: top-1 sends 2.5 (index 1)
    tensors, _ = cc.encode(0, torch.ones(4))
    assert tensors["c0/0/indices"].tolist() == [1] and tensors["c0/0/values"].tolist() == [2.5]
    assert cc.momentum.velocity("c0").tolist() == [1.0, 0.0, 0.0, 1.25]
    assert cc.feedback.residual("c0").tolist() == [1.0, 0.0, -2.0, 1.75]


def test_sign_with_momentum_is_ef_sgd_with_momentum_and_keeps_the_velocity() -> None:
    cc = ChunkCompressor("sign", one_chunk(4), momentum=WorkerMomentum(0.5))
    g1, g2 = torch.tensor([4.0, 0.0, 0.0, 0.0]), torch.tensor([-3.5, -3.5, 6.5, -5.5])
    cc.encode(0, g1)
    # p1 = u1 = g1: rms 2 is above 1.5 x mean |p1| = 1.5, so the scale is 1.5 (zeros go as +):
    # C(p1) = 1.5 * [1, 1, 1, 1]; e1 = [2.5, -1.5, -1.5, -1.5]
    # (the scale is rounded down by less than 2**-17 of it: SignCodec's docstring)
    tol = 8.0 * 2**-17
    assert cc.feedback.residual("c0").tolist() == pytest.approx([2.5, -1.5, -1.5, -1.5], abs=tol)
    cc.encode(0, g2)
    # u2 = 0.5 * g1 + g2 = [-1.5, -3.5, 6.5, -5.5] (no masking); p2 = u2 + e1 = [1, -5, 5, -7]:
    # rms 5 is below 1.5 x mean 4.5, so the scale is 5; C(p2) = 5 * [1, -1, 1, -1]; e2 = [-4, 0, 0, -2]
    assert cc.momentum.velocity("c0").tolist() == [-1.5, -3.5, 6.5, -5.5]
    assert cc.feedback.residual("c0").tolist() == pytest.approx([-4.0, 0.0, 0.0, -2.0], abs=2 * tol)


def test_randk_masks_the_momentum_where_it_sent() -> None:
    cc = ChunkCompressor("randk:0.5", one_chunk(8), momentum=WorkerMomentum(0.9), seed=3)
    g = torch.arange(1.0, 9.0)
    cc.encode(0, g)
    u, e = cc.momentum.velocity("c0"), cc.feedback.residual("c0")
    sent = e == 0
    assert int(sent.sum()) == 4
    assert u[sent].tolist() == [0.0] * 4 and u[~sent].tolist() == g[~sent].tolist()


def test_density_warmup_follows_dgc_schedule() -> None:
    # 25%, 6.3%, 1.6%, 0.4%, then the ratio (Lin et al. 2018, section 3.4)
    got = [warmup_density(0.001, s, 100) for s in (0, 24, 25, 50, 75, 99, 100, 5000)]
    assert got == [0.25, 0.25, 0.0629, 0.0158, 0.00398, 0.00398, 0.001, 0.001]
    assert warmup_density(0.5, 0, 100) == 0.5  # never below the ratio
    assert warm_spec("topk:0.001", 30, 100) == "topk:0.0629"
    assert warm_spec("sign", 0, 100) == "sign" and warm_spec("topk:0.3", 0, 100) == "topk:0.3"


def test_delayed_nesterov_equals_one_nesterov_step_on_the_mean_per_round() -> None:
    p = torch.zeros(1, requires_grad=True)
    opt = DelayedNesterov([p], lr=1.0, momentum=0.5, delay=2)
    seen = []
    # shares of pseudo-gradients 1, 3, 2, 2 from 2 workers (each divided by 2, as a DiLoCo worker pushes)
    for share in (0.5, 1.5, 1.0, 1.0):
        p.grad = torch.tensor([share])
        opt.step()
        seen.append(float(p.detach()))
    # arrivals: -share each; at the 2nd of a round m = 0.5 m + sum of the round's shares (the mean), p -= 0.5 m
    # round 1: -0.5, -2 then m = 2, -3; round 2: -4, -5 then m = 3, -6.5
    assert seen == [-0.5, -3.0, -4.0, -6.5]
    q = torch.zeros(1, requires_grad=True)
    ref = torch.optim.SGD([q], lr=1.0, momentum=0.5, nesterov=True)
    for mean in (2.0, 2.0):
        q.grad = torch.tensor([mean])
        ref.step()
    assert float(q.detach()) == seen[-1]


def test_async_diloco_round_of_shares_is_the_sync_outer_step() -> None:
    """The shards' async outer step on the shares 3 DiLoCo workers push (pseudo-gradient / 3) moves the
    model, over a round of arrivals, as the sync outer step on their sum does (it was a third of it)."""
    torch.manual_seed(0)
    pseudo = [[torch.randn(5) for _ in range(3)] for _ in range(4)]  # 4 rounds x 3 workers
    params = {}
    for outer in ("sync", "async"):
        exp = Experiment(**BASE, mode="diloco", outer_step=outer, min_workers=3)
        p = torch.zeros(5, requires_grad=True)
        opt = build_optimizer(ShardConfig.for_experiment(exp, "e", 0).optimizer, [p])
        if isinstance(opt, DelayedNesterov):
            opt.set_delay(3)  # the shard's N: the workers it serves
        for rnd in pseudo:
            shares = [g / 3 for g in rnd]
            for grad in ([sum(shares)] if outer == "sync" else shares):
                p.grad = grad
                opt.step()
        params[outer] = p.detach()
    torch.testing.assert_close(params["async"], params["sync"])


def test_where_momentum_runs() -> None:
    sign = Experiment(**BASE, mode="async", compression="sign", momentum=0.9)
    assert momentum_on_worker(sign) and density_warmup_steps(sign) == 0
    assert ShardConfig.for_experiment(sign, "e", 0).optimizer.momentum == 0
    topk = Experiment(**BASE, mode="sync", compression="topk:0.01", momentum=0.9, nesterov=True)
    assert momentum_on_worker(topk) and density_warmup_steps(topk) == 0  # no warm-up unless asked: it costs bytes
    warm = Experiment(**BASE, mode="async", compression="topk:0.01", momentum=0.9, warmup_steps=20)
    assert density_warmup_steps(warm) == 20
    assert ShardConfig.for_experiment(topk, "e", 0).optimizer.nesterov is False
    plain = Experiment(**BASE, mode="async", compression="int8", momentum=0.9)
    assert not momentum_on_worker(plain)
    assert ShardConfig.for_experiment(plain, "e", 0).optimizer.momentum == 0.9
    assert not momentum_on_worker(Experiment(**BASE, mode="async", compression="sign"))
    adiloco = ShardConfig.for_experiment(Experiment(**BASE, mode="diloco", outer_step="async", outer_momentum=0.9),
                                         "e", 0).optimizer
    assert adiloco.delayed and adiloco.momentum == 0.9 and not adiloco.nesterov
    sdiloco = ShardConfig.for_experiment(Experiment(**BASE, mode="diloco", outer_step="sync"), "e", 0).optimizer
    assert sdiloco.nesterov and not sdiloco.delayed
