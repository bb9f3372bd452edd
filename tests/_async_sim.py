"""In-process async parameter-server simulation for codec convergence: W workers take turns, no sockets.

Each worker computes its gradient on the parameters it pulled after its last push (version
staleness W - 1 once all have pushed), compresses it with the real `ChunkCompressor` (worker
momentum, error feedback, DGC masking as ps_trainer builds them) and the shard applies the
decoded update with plain SGD (or momentum SGD for codecs whose momentum runs on the shards)
at lr / max(1, staleness), the shards' default staleness-aware lr. Used by the tests and to
try codec variants in seconds instead of a threaded ZMQ run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.compression.momentum_placement import momentum_on_worker
from gossamer.compression.worker_momentum import WorkerMomentum
from gossamer.core.experiment import Experiment
from gossamer.engine.model import build
from gossamer.engine.shard_plan import ShardPlan, flatten_params, unflatten_into


def simulate(exp: Experiment, workers: int = 3, steps: int | None = None, *, placement: str = "auto",
             error_feedback: bool | None = None, unbiased_random: bool | None = None) -> float:
    """Train `exp` (digits-like: tensors dataset, cross entropy) asynchronously in-process; eval accuracy.

    `placement` "auto" (as the real run), "worker" or "shard": where the momentum runs;
    `error_feedback` None (the codec's default) or forced on/off; `unbiased_random` None
    (as ps_trainer: with the momentum on the worker) or forced.
    """
    torch.set_num_threads(1)
    model, train, held = build(exp, torch.device("cpu"))
    x_all, y_all = train.tensors
    plan = ShardPlan.for_experiment(model, exp)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    on_worker = momentum_on_worker(exp) if placement == "auto" else placement == "worker"
    comps = [
        ChunkCompressor(exp.compression, plan, shapes=shapes, seed=exp.seed * 1000 + w,
                        error_feedback=error_feedback,
                        unbiased_random=on_worker if unbiased_random is None else unbiased_random,
                        momentum=WorkerMomentum(exp.momentum, nesterov=exp.nesterov) if on_worker else None)
        if exp.compression != "none" else None
        for w in range(workers)
    ]
    shard_momentum = 0.0 if on_worker else exp.momentum
    server = flatten_params(model)
    velocity = torch.zeros_like(server)
    version = 0
    basis = [0] * workers
    local = [server.clone() for _ in range(workers)]
    gen = torch.Generator().manual_seed(exp.seed)
    total = steps if steps is not None else exp.total_steps
    for t in range(total):
        w = t % workers
        unflatten_into(model, local[w])
        idx = torch.randint(len(x_all), (exp.batch_size,), generator=gen)
        model.zero_grad()
        F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if comps[w] is not None:
            parts = []
            for c in plan.chunks:
                g = grad[c.flat_offset:c.flat_offset + c.numel]
                tensors, meta = comps[w].encode(c.index, g)
                parts.append(comps[w].decode(c.index, tensors, meta))
            grad = torch.cat(parts)
        if not torch.isfinite(grad).all():
            return float("nan")
        lr = exp.lr / max(1, version - basis[w])
        if shard_momentum:
            velocity.mul_(shard_momentum).add_(grad)
            grad = grad + shard_momentum * velocity if exp.nesterov else velocity
        server -= lr * grad
        version += 1
        basis[w] = version
        local[w] = server.clone()
    unflatten_into(model, server)
    xe, ye = held.tensors
    with torch.no_grad():
        return float((model(xe).argmax(1) == ye).float().mean())


if __name__ == "__main__":
    import argparse
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--codec", default="none")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--placement", default="auto")
    ap.add_argument("--ef", default="auto")
    ap.add_argument("--nomask", action="store_true")
    ap.add_argument("--biased", action="store_true", help="randk: error feedback, no rescaling (the old way)")
    a = ap.parse_args()
    if a.nomask:
        WorkerMomentum.mask = lambda self, key, sent: None  # type: ignore[method-assign]
    ef = {"auto": None, "on": True, "off": False}[a.ef]
    extra = {} if a.model == "mlp" else {"model": "gossamer.examples.digits:cnn",
                                          "dataset": "gossamer.examples.digits:cnn_data"}
    for seed in range(a.seeds):
        kw = {"model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data", **extra}
        exp = Experiment(name="sim", mode="async", lr=0.05, momentum=a.momentum, num_ps_shards=2,
                         total_steps=a.steps, compression=a.codec, seed=seed, **kw)
        t0 = time.process_time()
        acc = simulate(exp, a.workers, placement=a.placement, error_feedback=ef,
                       unbiased_random=False if a.biased else None)
        print(f"{a.model} {a.codec} m={a.momentum} seed={seed}: {acc:.4f} ({time.process_time() - t0:.1f} cpu-s)",
              flush=True)
