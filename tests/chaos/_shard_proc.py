"""A shard server in its own process (started by chaos tests): writes its endpoint to a file, serves until killed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch


def shard_config(mode: str = "async", staleness: int | None = None, checkpoint_every: int = 0):  # type: ignore[no-untyped-def]
    from gossamer.paramserver import OptimizerConfig, ShardConfig

    return ShardConfig(experiment="chaos", shard=0, mode=mode, staleness=staleness,
                       optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9), total_steps=10**9,
                       checkpoint_every=checkpoint_every, backup_timeout_s=5.0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def promote_file(endpoint_file: str) -> Path:
    """Where a test, playing the coordinator, writes the fencing epoch a backup is promoted at."""
    return Path(endpoint_file + ".promote")


def start_shard(tmp: Path, name: str, *, backup: bool, backup_endpoint: str = "", fault: str = "",
                sender_key: str = "") -> tuple[Any, str]:
    """`serve` in its own process (forked warm) writing its endpoint to TMP/NAME.endpoint; the process and that endpoint."""
    # Imported here: the shard process imports this module, and needs none of the fixtures' imports
    from tests._fixtures import warm_context

    path = tmp / f"{name}.endpoint"
    proc = warm_context().Process(target=serve, args=(str(path), backup, backup_endpoint, fault, sender_key),
                                           daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.is_alive() and time.monotonic() < deadline, f"{name} did not start"
        time.sleep(0.05)
    return proc, path.read_text()


def promote(tmp: Path, name: str, epoch: int = 1) -> None:
    """What the coordinator's promotion does: shard NAME (a backup) becomes primary at `epoch`."""
    order = promote_file(str(tmp / f"{name}.endpoint"))
    staged = Path(f"{order}.tmp")
    staged.write_text(str(epoch))
    staged.rename(order)  # whole, or not at all


def _follow_promotion(server, endpoint_file: str) -> None:  # type: ignore[no-untyped-def]
    path = promote_file(endpoint_file)
    while not path.exists():
        threading.Event().wait(0.02)
    epoch = int(path.read_text())
    server.post(lambda: server.promote("promoted by the test's coordinator", epoch))


def serve(endpoint_file: str, backup: bool, backup_endpoint: str, fault: str = "", sender_key: str = "") -> None:
    """Serve shard 0 of `model()`; as primary, replicate to `backup_endpoint`; as backup, become
    the primary when `promote_file` appears (only the coordinator's word promotes); `sender_key`:
    check senders' tokens under it, as shards the coordinator started do."""
    if fault:
        os.environ["GOSSAMER_FAULT"] = fault
    torch.set_num_threads(1)
    from gossamer.paramserver import ShardPlan, ShardServer, flatten_params

    m = model()
    plan = ShardPlan.for_module(m, 1, chunk_numel=200)
    flat = flatten_params(m)
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in plan.chunks}
    server = ShardServer(shard_config(), plan, init, backup=backup)
    server.set_sender_key(sender_key)
    endpoint = server.bind()
    if backup_endpoint:
        server.post(lambda: server.set_backup(backup_endpoint))
    if backup:
        threading.Thread(target=_follow_promotion, args=(server, endpoint_file), daemon=True).start()
    tmp = Path(endpoint_file + ".tmp")
    tmp.write_text(endpoint)
    tmp.rename(endpoint_file)
    server.serve(threading.Event())


def push_forever(endpoint: str, sender: str, step_s: float) -> None:
    """A worker process pushing random gradients every `step_s` until it is killed."""
    import time

    torch.set_num_threads(1)
    from gossamer.paramserver import ShardClient, ShardPlan

    plan = ShardPlan.for_module(model(), 1, chunk_numel=200)
    client = ShardClient(experiment="chaos", sender=sender, plan=plan, endpoints={0: endpoint})
    client.hello(fresh=True)
    clock = 0
    while True:
        grads = {c.index: torch.randn(c.numel) * 0.01 for c in plan.chunks}
        client.push_pull(grads, clock=clock, basis={0: 0})
        clock += 1
        time.sleep(step_s)
