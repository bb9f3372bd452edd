"""A PUSH answered with an ack (meta "reply": "ack"): the shard's PARAMS carries its version and no values, which
the worker then pulls a group of chunks at a time (a shard replica in its own process, real ZMQ)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import pytest
import torch

from bench._replicated_pair import EXPERIMENT, NUMEL, plan, replica
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.core.errors import ProtocolError
from gossamer.core.protocol import PushMeta
from gossamer.engine.shard_plan import chunk_groups
from gossamer.paramserver import ShardClient

pytestmark = pytest.mark.timeout(300)
_SPAWN = mp.get_context("spawn")


@pytest.fixture
def primary() -> Iterator[str]:
    """A sync shard (no backup) in its own process; yields its endpoint."""
    parent, child = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=replica, args=(child, False), daemon=True)
    proc.start()
    try:
        conn: Connection = parent
        assert conn.poll(120), "the shard did not start"
        yield conn.recv()
        conn.send("stop")
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


def test_an_acked_push_carries_no_values_and_group_pulls_give_the_step_s_values(primary: str) -> None:
    """Two int8 workers at a barrier, one asking for an ack and one for the values: the ack is a PARAMS of the
    new version without tensors (a few hundred bytes where the values are 64 MiB); pulled by groups of chunks,
    each reply carries its group only, and together they are bit for bit the values the other worker got."""
    p = plan()
    workers = [ShardClient(experiment=EXPERIMENT, sender=f"w{i}", plan=p, endpoints={0: primary}, timeout_s=120,
                           compressor=ChunkCompressor("int8", p, shapes={"w": (NUMEL,)}, seed=i)) for i in range(2)]
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(2):
            grads = [{c.index: torch.randn(c.numel, generator=g) for c in p.chunks} for _ in workers]
            down = workers[0].bytes_down
            with ThreadPoolExecutor(2) as pool:
                futures = [pool.submit(w.push_pull, gr, clock=step, basis={0: step}, step=step, num_workers=2,
                                       values=i == 1)
                           for i, (w, gr) in enumerate(zip(workers, grads, strict=True))]
                acked, full = (f.result(timeout=120) for f in futures)
            assert acked.values == {} and acked.versions == {0: step + 1}
            assert workers[0].bytes_down - down < 4096, workers[0].bytes_down - down
            assert full.versions == {0: step + 1} and sorted(full.values) == [c.index for c in p.chunks]
            budget = 3 * 4 * p.chunks[0].numel
            groups = chunk_groups(workers[0].chunks_of_shard(0), p.chunks, budget)
            assert len(groups) > 1 and all(sum(4 * p.chunks[i].numel for i in gr) <= budget for gr in groups)
            pulled: dict[int, torch.Tensor] = {}
            for group in groups:
                res = workers[0].pull([0], chunks=group)
                assert res.versions == {0: step + 1} and sorted(res.values) == group
                pulled.update(res.values)
            assert sorted(pulled) == sorted(full.values)
            for i, v in full.values.items():
                assert torch.equal(pulled[i], v), i
    finally:
        for w in workers:
            w.close()


def test_a_push_reply_other_than_values_or_ack_is_refused() -> None:
    assert PushMeta.from_meta({"clock": 0, "basis": 0, "reply": "ack"}, barrier=False).values is False
    assert PushMeta.from_meta(PushMeta(clock=0, basis=0, step=0, num_workers=2).to_meta(), barrier=True).values
    assert PushMeta.from_meta(PushMeta(clock=1, basis=0, values=False).to_meta(), barrier=False).values is False
    with pytest.raises(ProtocolError, match="reply"):
        PushMeta.from_meta({"clock": 0, "basis": 0, "reply": "later"}, barrier=False)
