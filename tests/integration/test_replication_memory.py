"""What a primary and its backup hold while replicating compressed pushes: no dense copy of a worker's
push beside the sum, no forwarded payload once decoded (real replicas in their own processes, real ZMQ)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import pytest
import torch

from bench._replicated_pair import EXPERIMENT, NUMEL, plan, replica
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.paramserver import ShardClient
from gossamer.paramserver._replication import SYNC_PART_BYTES

pytestmark = pytest.mark.timeout(300)
_SPAWN = mp.get_context("spawn")
_MIB = 1 << 20


def _ask(conn: Connection, request: object) -> object:
    conn.send(request)
    assert conn.poll(120), f"no answer to {request!r}"
    return conn.recv()


@pytest.fixture(params=["sync"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Connection, Connection, str]]:
    """A primary and its synced backup, each in its own process (in the mode of the parameter: sync unless a
    test says otherwise); yields their pipes and the primary's endpoint."""
    pipes = [_SPAWN.Pipe() for _ in range(2)]
    procs = [_SPAWN.Process(target=replica, args=(child, backup, request.param), daemon=True)
             for (_, child), backup in zip(pipes, (False, True), strict=True)]
    for proc in procs:
        proc.start()
    try:
        primary, backup = (parent for parent, _ in pipes)
        endpoints = []
        for conn in (primary, backup):
            assert conn.poll(120), "a replica did not start"
            endpoints.append(conn.recv())
        assert _ask(primary, ("attach", endpoints[1])) is True
        yield primary, backup, endpoints[0]
        for conn in (primary, backup):
            conn.send("stop")
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


def test_a_backup_holds_its_state_the_forwarded_payload_and_the_sum_a_group_of_chunks_at_a_time(
        pair: tuple[Connection, Connection, str]) -> None:
    """Two int8 workers, sync steps: each step's two pushes are forwarded encoded. The backup's peak over
    its synced state is its momentum (1x the shard), the forwarded payload (~0.5x) and the step's sum one
    group of chunks at a time, not the whole sum (1x) nor each push's dense decode. The primary's peak is bounded likewise (bit-identity is test_replication_encoded's)."""
    primary, backup, endpoint = pair
    p = plan()
    shard = 4 * NUMEL
    workers = [ShardClient(experiment=EXPERIMENT, sender=f"w{i}", plan=p, endpoints={0: endpoint}, timeout_s=120,
                           compressor=ChunkCompressor("int8", p, shapes={"w": (NUMEL,)}, seed=i)) for i in range(2)]
    g = torch.Generator().manual_seed(0)
    grads = [{c.index: torch.randn(c.numel, generator=g) for c in p.chunks} for _ in workers]
    payload = 0
    rss = {}
    try:
        rss = {"primary": _ask(primary, "reset"), "backup": _ask(backup, "reset")}
        steps = 3
        with ThreadPoolExecutor(2) as pool:
            for step in range(steps):
                futures = [pool.submit(w.push_pull, gr, clock=step, basis={0: step}, step=step, num_workers=2)
                           for w, gr in zip(workers, grads, strict=True)]
                for f in futures:
                    f.result(timeout=120)
        payload = sum(w.compressor.wire_bytes for w in workers if w.compressor is not None) // steps
    finally:
        for w in workers:
            w.close()
    peaks = {"primary": _ask(primary, "peak"), "backup": _ask(backup, "peak")}
    assert peaks["primary"][1] == peaks["backup"][1] == 3, peaks  # type: ignore[index]
    grown = {role: peaks[role][0] - rss[role] for role in rss}  # type: ignore[index,operator]
    # int8: a quarter of the dense bytes and a scale per block; forwarded only when smaller than the sum
    assert 0 < payload < shard, payload
    # Held: momentum (1x), the payload, and the step's sum a group of chunks (16 MiB, a quarter of this shard)
    # at a time. Measured 2.03x (payload 0.5x included; 3 runs, quiet). What the test proves: less than one whole
    # dense sum beside those (holding it measured 2.91x; with a push's dense copy too, 3.73x).
    assert grown["backup"] < 2 * shard + payload, (grown, shard, payload)
    # The primary: momentum, the pushes' payloads (held encoded until the step, then forwarded), the values a
    # reply may still read written aside (one copy), and the sum a group at a time. Measured 2.11x (3 runs, quiet;
    # 2.67x to 3.07x when the replicas kept glibc's adaptive mmap threshold, unlike a role process);
    # less than half a dense sum beyond those (the whole sum measured 3.22x; with a push's dense copy, 5.14x).
    assert grown["primary"] < 2.5 * shard + payload, (grown, shard, payload)
    print(f"shard {shard / _MIB:.0f} MiB, payload/step {payload / _MIB:.1f} MiB, grown "
          + ", ".join(f"{r} {v / shard:.2f}x" for r, v in grown.items()) + f" ({time.monotonic():.0f})")


def test_a_sync_primary_holds_the_step_s_sum_and_a_part_not_every_worker_s_dense_push(
        pair: tuple[Connection, Connection, str]) -> None:
    """Two dense workers at a barrier, 64 MiB pushes: each goes in parts under 16 MiB, added into the step's sum
    as it comes, so the primary holds its state, the sum (the first worker's parts) and the part being read.
    Sent whole, the second worker's push was read while the first was held: both beside the state. Measured
    over the state (after a first step made the momentum): see the print."""
    primary, backup, endpoint = pair
    p = plan()
    shard = 4 * NUMEL
    workers = [ShardClient(experiment=EXPERIMENT, sender=f"w{i}", plan=p, endpoints={0: endpoint}, timeout_s=120)
               for i in range(2)]

    def step(k: int, at: int) -> None:
        grads = {c.index: torch.randn(c.numel, generator=torch.Generator().manual_seed(7 * at + k)) for c in p.chunks}
        workers[k].push_pull(grads, clock=at, basis={0: at}, step=at, num_workers=2)

    rss = {}
    steps = 4
    try:
        with ThreadPoolExecutor(2) as pool:
            for at in range(steps):
                if at == 1:  # values and momentum on both replicas
                    rss = {"primary": _ask(primary, "reset"), "backup": _ask(backup, "reset")}
                for f in [pool.submit(step, k, at) for k in range(2)]:
                    f.result(timeout=120)
    finally:
        for w in workers:
            w.close()
    peaks = {"primary": _ask(primary, "peak"), "backup": _ask(backup, "peak")}
    assert peaks["primary"][1] == peaks["backup"][1] == steps, peaks  # type: ignore[index]
    grown = {role: peaks[role][0] - rss[role] for role in rss}  # type: ignore[index,operator]
    # The sum (1x) and parts; main before this held both workers' pushes (2x) and more.
    assert grown["primary"] < 1.5 * shard, (grown, shard)
    print(f"shard {shard / _MIB:.0f} MiB, sync dense, grown over the state: "
          + ", ".join(f"{r} {v / shard:.2f}x" for r, v in grown.items()))


def _train_async(endpoint: str, steps: int, primary: Connection, backup: Connection) -> dict[str, int]:
    """Two dense workers pushing at once, async (the primary applies their updates back to back): the growth
    of each replica's peak RSS over its whole state, after a first update each made the momentum buffers."""
    p = plan()
    workers = [ShardClient(experiment=EXPERIMENT, sender=f"w{i}", plan=p, endpoints={0: endpoint}, timeout_s=120)
               for i in range(2)]
    together = threading.Barrier(2, timeout=120)  # both pushes of a clock start at once

    def train(k: int, clocks: range) -> None:
        for clock in clocks:
            grads = {c.index: torch.randn(c.numel, generator=torch.Generator().manual_seed(7 * clock + k))
                     for c in p.chunks}
            together.wait()
            workers[k].push_pull(grads, clock=clock, basis={0: 0})
            del grads

    rss = {}
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(train, k, range(1)) for k in range(2)]:
                f.result(timeout=120)
            rss = {"primary": _ask(primary, "reset"), "backup": _ask(backup, "reset")}
            for f in [pool.submit(train, k, range(1, steps)) for k in range(2)]:
                f.result(timeout=120)
    finally:
        for w in workers:
            w.close()
    peaks = {"primary": _ask(primary, "peak"), "backup": _ask(backup, "peak")}
    assert peaks["primary"][1] == peaks["backup"][1] == 2 * steps, peaks  # type: ignore[index]
    return {role: peaks[role][0] - rss[role] for role in rss}  # type: ignore[index,operator]


@pytest.mark.parametrize("pair", ["async"], indirect=True)
def test_an_async_backup_holds_one_forwarded_dense_update_at_a_time(pair: tuple[Connection, Connection, str]) -> None:
    """A REPLICATE goes while those the backup has not acknowledged stay within the window (64 MiB): these
    64 MiB dense updates go one at a time, so the backup holds its state and one update's gradient (1x the
    shard), not every update the primary sent meanwhile. Measured over the state: backup 1.00x-1.06x (main,
    every REPLICATE sent at once: 1.87x-2.00x); primary 1.94x-2.00x, the two pushes ZMQ read as they came,
    before push credits (1.06x with them: the next test)."""
    primary, backup, endpoint = pair
    shard = 4 * NUMEL
    grown = _train_async(endpoint, 5, primary, backup)
    stats = _ask(primary, "stats")
    waited = stats["replicate_window_waits"]  # type: ignore[index]
    assert waited > 0, "no REPLICATE waited for the window: the test shows nothing"
    assert grown["backup"] < 1.5 * shard, (grown, shard)
    assert grown["primary"] < 2.5 * shard, (grown, shard)
    print(f"shard {shard / _MIB:.0f} MiB, {waited} REPLICATEs waited for an ACK, "
          f"{stats['cow_copies']} writes aside (kept back {stats['push_deferrals']}), grown over the state: "  # type: ignore[index]
          + ", ".join(f"{r} {v / shard:.2f}x" for r, v in grown.items()))


@pytest.mark.parametrize("pair", ["async"], indirect=True)
def test_an_async_primary_reads_one_dense_push_at_a_time(pair: tuple[Connection, Connection, str]) -> None:
    """Two workers' 64 MiB dense pushes at once: each asks the primary for a credit first and is sent when
    granted, once the primary holds no other push (to apply, or still to forward to its backup), so it holds
    its state and one push, not the other worker's too. Measured over the state, same machine, same test:
    primary 1.06x (four runs); 2.06x without credits; 1.13x-1.81x with credits that did not count the pushes
    still held for the backup."""
    primary, backup, endpoint = pair
    shard = 4 * NUMEL
    grown = _train_async(endpoint, 5, primary, backup)
    stats = _ask(primary, "stats")
    assert stats["credit_waited"] > 0, "no push waited for a credit: the test shows nothing"  # type: ignore[index]
    assert stats["credit_peak_bytes"] == shard, stats  # type: ignore[index]
    assert grown["primary"] < 1.3 * shard, (grown, shard)
    print(f"shard {shard / _MIB:.0f} MiB, {stats['credit_waited']} pushes waited for a credit, "  # type: ignore[index]
          f"{stats['push_deferrals']} kept back, {stats['cow_copies']} writes aside of values a reply "  # type: ignore[index]
          f"still sent; grown over the state: primary {grown['primary'] / shard:.2f}x")


@pytest.mark.parametrize("pair", ["async"], indirect=True)
def test_a_window_of_several_updates_lets_them_go_at_once(pair: tuple[Connection, Connection, str]) -> None:
    """The same run with a window of four of these updates (as the default window is for a 16 MiB shard's):
    nothing waits for an ACK, the REPLICATEs pipeline as main's did."""
    primary, backup, endpoint = pair
    _ask(primary, ("window", 4 * 4 * NUMEL + (1 << 20)))
    _train_async(endpoint, 3, primary, backup)
    assert _ask(primary, "stats")["replicate_window_waits"] == 0  # type: ignore[index]


@pytest.mark.parametrize("pair", ["async"], indirect=True)
def test_a_re_synced_backup_loads_the_sync_in_parts_not_beside_its_old_state(
        pair: tuple[Connection, Connection, str]) -> None:
    """A backup detached and attached again gets a full SYNC of values and momentum (2x the shard). Sent as
    one message, ZMQ read all of it while the backup still held its old state: 4x. In parts of a few chunks,
    each loaded into place and dropped as it comes, the backup holds its state and the parts read ahead.
    The state after it is the primary's, bit for bit."""
    primary, backup, endpoint = pair
    shard = 4 * NUMEL
    _train_async(endpoint, 2, primary, backup)  # values and momentum on both replicas
    before = _ask(backup, "stats")["sync_parts_in"]  # type: ignore[index]
    rss = _ask(backup, "reset")
    assert _ask(primary, "resync") is True
    peak, version = _ask(backup, "peak")  # type: ignore[misc]
    parts = _ask(backup, "stats")["sync_parts_in"] - before  # type: ignore[index]
    assert parts >= 2 * shard // SYNC_PART_BYTES, parts  # values and momentum, 16 MiB at a time
    assert _ask(primary, "digest") == _ask(backup, "digest")
    grown = peak - rss  # type: ignore[operator]
    # Measured: see the print. One message (main before this) held the whole new state beside the old: 2x.
    assert grown < 0.75 * shard, (grown, shard)
    print(f"shard {shard / _MIB:.0f} MiB, SYNC in {parts} parts at version {version}: the backup grew "
          f"{grown / shard:.2f}x of the shard over its state")
