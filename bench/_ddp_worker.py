"""One rank of the torch DDP (gloo) baseline of bench/wan.py; run inside a host's network namespace.

    python -m bench._ddp_worker --rank R --world 4 --master 10.77.0.1:29500 --ifname eth0 \
        --config '{"model": ..., "batch_size": 32, ...}' --log rank0.jsonl

Same workload as gossamer's sync mode, step for step: the model built with the same seed, the
global batch of step t chosen by gossamer's own sampler (`sync_global_batch`, split evenly over
the ranks), the loss averaged over the global batch (DDP averages the ranks' mean losses), torch
SGD with the same lr and momentum. Rank 0 evaluates every `eval_every` steps with gossamer's
`evaluate` and appends JSON lines to --log: {"event": "start"|"eval"|"end", "time_unix", "step",
"samples", "eval_accuracy", "eval_loss"}.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import time


def _resolve(path: str):  # type: ignore[no-untyped-def]
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="HOST:PORT of rank 0's TCP store")
    ap.add_argument("--ifname", default="eth0", help="interface gloo uses (GLOO_SOCKET_IFNAME)")
    ap.add_argument("--config", required=True, help="JSON: model, model_args, dataset, batch_size, lr, ...")
    ap.add_argument("--log", required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    cfg = json.loads(args.config)
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gossamer.engine.model import evaluate
    from gossamer.engine.sampler import even_split, sync_global_batch

    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.get("seed", 0))
    model = _resolve(cfg["model"])(**cfg.get("model_args", {}))
    train, evalset = _resolve(cfg["dataset"])(**cfg.get("dataset_args", {}))
    x_all, y_all = train.tensors
    n = len(train)
    batch, world, rank = cfg["batch_size"], args.world, args.rank
    g = batch * world
    steps, every, seed = cfg["total_steps"], cfg["eval_every"], cfg.get("seed", 0)
    log = open(args.log, "a", buffering=1) if rank == 0 else None  # noqa: SIM115

    def write(rec: dict) -> None:  # type: ignore[type-arg]
        if log is not None:
            log.write(json.dumps(rec) + "\n")

    host, _, port = args.master.rpartition(":")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=cfg.get("momentum", 0.0),
                          nesterov=cfg.get("nesterov", False), weight_decay=cfg.get("weight_decay", 0.0))
    dist.barrier()
    t0 = time.time()
    write({"event": "start", "time_unix": t0, "step": 0, "samples": 0,
           "params": sum(p.numel() for p in model.parameters())})
    samples = 0
    for step in range(steps):
        idx = even_split(sync_global_batch(n, g, step, seed), world, rank)
        out = ddp(x_all[idx])
        loss = F.cross_entropy(out, y_all[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        samples += g
        done = step + 1
        if rank == 0 and every and done % every == 0 and done < steps:
            acc, el = evaluate(model, evalset, torch.device("cpu"))
            write({"event": "eval", "time_unix": time.time(), "step": done, "samples": samples,
                   "eval_accuracy": acc, "eval_loss": el, "loss": loss.item()})
    t_end = time.time()
    if rank == 0:
        acc, el = evaluate(model, evalset, torch.device("cpu"))
        write({"event": "eval", "time_unix": time.time(), "step": steps, "samples": samples,
               "eval_accuracy": acc, "eval_loss": el, "loss": loss.item()})
        write({"event": "end", "time_unix": t_end, "step": steps, "samples": samples, "train_s": t_end - t0})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
