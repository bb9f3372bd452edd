"""A 1M-parameter shard in its own process for the memory-bound tests: membership read from a file, as a role gets it."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

NUMEL = 1 << 20  # 4 MiB of fp32 values: one copy is plainly visible in the process's RSS
EXPERIMENT = "bounds"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(1024, 1024, bias=False)


def plan():  # type: ignore[no-untyped-def]
    from gossamer.paramserver import ShardPlan

    return ShardPlan.for_module(model(), 1, chunk_numel=NUMEL)


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def serve(endpoint_file: str, members_file: str) -> None:
    """Serve shard 0 of `model()`; the workers listed in `members_file` (JSON) are the members,
    posted to the serve thread whenever the file changes (what an assignment update does)."""
    torch.set_num_threads(1)
    from gossamer.paramserver import OptimizerConfig, ShardConfig, ShardServer, flatten_params

    p = plan()
    flat = flatten_params(model())
    init = {c.index: flat[c.flat_offset : c.flat_offset + c.numel].clone() for c in p.chunks}
    config = ShardConfig(experiment=EXPERIMENT, shard=0, mode="async", staleness=None,
                         optimizer=OptimizerConfig(name="sgd", lr=0.01), total_steps=10**9, expect_backup=False)
    server = ShardServer(config, p, init)
    endpoint = server.bind()
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    tmp = Path(endpoint_file + ".tmp")
    tmp.write_text(endpoint)
    tmp.rename(endpoint_file)
    seen = 0.0
    while thread.is_alive():
        try:
            mtime = os.stat(members_file).st_mtime_ns
        except FileNotFoundError:
            mtime = 0
        if mtime and mtime != seen:
            try:
                members = json.loads(Path(members_file).read_text())
            except ValueError:  # caught between the writer's truncate and its write: read it again next time
                time.sleep(0.01)
                continue
            seen = mtime
            server.post(lambda m=members: server.set_members(m))  # type: ignore[misc]
        time.sleep(0.05)


def pull_forever(endpoint: str, sender: str, pull_codec: str) -> None:
    """A worker that pulls with `pull_codec` until it is killed (it never says LEAVE)."""
    torch.set_num_threads(1)
    from gossamer.paramserver import ShardClient

    client = ShardClient(experiment=EXPERIMENT, sender=sender, plan=plan(), endpoints={0: endpoint},
                         pull_codec=pull_codec)
    client.hello(fresh=True)
    while True:
        client.pull()
        time.sleep(0.01)
