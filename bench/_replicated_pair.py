"""A shard replica (primary or backup) in its own process, for the replication tests and bench/replication_window.py: its peak resident set over the updates it applies."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

NUMEL = 16 << 20  # 64 MiB of fp32 values in 16 chunks of 1M: a copy of the shard is plain in the RSS
EXPERIMENT = "replmem"


def plan():  # type: ignore[no-untyped-def]
    from gossamer.paramserver import ShardPlan

    return ShardPlan.build([("w", NUMEL)], 1)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/self/status")


def replica(conn: Connection, backup: bool, mode: str = "sync") -> None:
    """Serve shard 0 (in `mode`, Nesterov momentum); answer the test's requests on `conn`:
    ("attach", endpoint): attach that backup and wait until it is synced; "reset": reset the peak
    RSS (clear_refs 5) and answer the current RSS in bytes; "peak": answer (peak RSS bytes, version);
    ("window", bytes): set its REPLICATE window; "stats": answer its stats; "resync": detach the backup and
    attach it again (a full SYNC), once it is synced again; "digest": a hash of its whole state and version."""
    torch.set_num_threads(1)
    from gossamer.engine.allocator import mmap_large_allocations
    from gossamer.paramserver import OptimizerConfig, ShardConfig, ShardServer

    # As a shard host's role process does at start (`_role_process.setup`): without it, what glibc
    # keeps of freed buffers in its heaps (2.67x to 3.07x for the primary) hides what the shard holds.
    mmap_large_allocations()

    # As a shard role process does at start (`ServerRole._start`): the codecs' torch paths, no numba.
    from gossamer.compression.kernels import kernels_unless_asked

    kernels_unless_asked()

    p = plan()
    config = ShardConfig(experiment=EXPERIMENT, shard=0, mode=mode, staleness=None,
                         optimizer=OptimizerConfig(name="sgd", lr=0.01, momentum=0.9, nesterov=True),
                         total_steps=10**6, backup_timeout_s=600.0)
    server = ShardServer(config, p, {c.index: torch.zeros(c.numel) for c in p.chunks},
                         shapes={"w": (NUMEL,)}, backup=backup)
    server.start()
    conn.send(server.endpoint)
    try:
        while True:
            request = conn.recv()
            if request == "stop":
                return
            if isinstance(request, tuple) and request[0] == "window":
                server._replication.window_bytes = request[1]  # noqa: SLF001 — the test sizes the window
                conn.send(True)
            elif request == "stats":
                conn.send(server.stats())
            elif request == "resync":
                endpoint = server._replication.backup_endpoint  # noqa: SLF001 — the test re-attaches the same backup
                server.post(lambda e=endpoint: (server.set_backup(""), server.set_backup(e)))
                _wait_replicated(server)
                conn.send(True)
            elif request == "digest":
                conn.send(_digest(server))
            elif isinstance(request, tuple):
                endpoint = request[1]
                server.post(lambda e=endpoint: server.set_backup(e))
                _wait_replicated(server)
                conn.send(True)
            elif request == "reset":
                Path("/proc/self/clear_refs").write_text("5")
                conn.send(_status_kb("VmRSS") * 1024)
            elif request == "peak":
                conn.send((_status_kb("VmHWM") * 1024, server.version))
    finally:
        server.close()


def _wait_replicated(server) -> None:  # type: ignore[no-untyped-def]
    time.sleep(0.05)  # the posted detach runs first
    deadline = time.monotonic() + 120
    while not server.replicated:
        assert time.monotonic() < deadline, "the backup did not sync"
        time.sleep(0.01)


def _digest(server) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    import hashlib

    state = server.state_dict()
    h = hashlib.sha256()
    for idx in sorted(state["values"]):
        h.update(state["values"][idx].numpy().tobytes())
    for entry in state["optimizer"]["state"].values():
        for name in sorted(entry):
            value = entry[name]
            h.update(name.encode() + (value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode()))
    return int(state["version"]), h.hexdigest()
