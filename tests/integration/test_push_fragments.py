"""An async dense push as fragments: gathered into one update, each fragment answered once its chunks are stepped."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
import torch

from gossamer.core.protocol import PushMeta
from gossamer.paramserver import OptimizerConfig, ShardClient, ShardConfig, ShardPlan, ShardServer
from gossamer.paramserver import _state as state_module
from gossamer.paramserver._push_side import PushRound
from gossamer.paramserver.push_parts import fragments, most_fragments
from gossamer.transport.frames import Message, encode

pytestmark = pytest.mark.timeout(120)

CHUNK = 16_384  # values: 64 KiB a chunk
FRAGMENT = 200_000  # bytes: 3 chunks a fragment, 11 fragments for the 32 chunks


def test_fragments_are_whole_chunks_in_order_each_but_the_last_saying_more_follow() -> None:
    rng = random.Random(3)
    for _ in range(200):
        sizes = [rng.randint(1, 60) for _ in range(rng.randint(1, 14))]
        msg = Message(op="PUSH", experiment="e", shard=0, sender="w:0", meta={"rid": 7, "clock": 2, "basis": 1},
                      tensors={f"c{i}": torch.zeros(n) for i, n in enumerate(sizes)})
        budget = rng.randint(8, 300)
        pieces = fragments(msg, budget)
        assert [name for p in pieces for name in p.tensors] == list(msg.tensors)  # every chunk once, in order
        assert len(pieces) <= most_fragments(4 * sum(sizes), budget)
        for k, piece in enumerate(pieces):
            assert piece.meta["rid"] == 7 and piece.meta["clock"] == 2
            assert piece.meta.get("more", False) is (k < len(pieces) - 1)
            nbytes = sum(4 * t.numel() for t in piece.tensors.values())
            assert nbytes < budget or len(piece.tensors) == 1 or len(pieces) == 1


def test_push_meta_more_without_a_barrier_round_trips_and_must_be_a_bool() -> None:
    meta = PushMeta(clock=3, basis=2, more=True).to_meta()
    assert meta["more"] is True and "part" not in meta
    assert PushMeta.from_meta(meta, barrier=False).more
    assert not PushMeta.from_meta(PushMeta(clock=3, basis=2).to_meta(), barrier=False).more
    with pytest.raises(Exception, match="'more' must be a bool"):
        PushMeta.from_meta({"clock": 3, "basis": 2, "more": 1}, barrier=False)
    with pytest.raises(Exception, match="'part' is for a shard with a barrier"):
        PushMeta.from_meta({"clock": 3, "basis": 2, "part": 0}, barrier=False)


@pytest.fixture
def shards() -> Iterator[tuple[ShardPlan, list[ShardServer], list[str]]]:
    """Two identical shards (32 chunks of 64 KiB, SGD with momentum), each served on its own thread."""
    plan = ShardPlan.build([("w", 32 * CHUNK)], 1, chunk_numel=CHUNK)
    config = ShardConfig(experiment="frag", shard=0, mode="async", staleness=None, total_steps=1000,
                         optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
    init = torch.randn(32 * CHUNK, generator=torch.Generator().manual_seed(0))
    servers = [ShardServer(config, plan, {c.index: init[c.flat_offset:c.flat_offset + c.numel].clone()
                                          for c in plan.chunks}) for _ in range(2)]
    endpoints = [s.bind() for s in servers]
    for s in servers:
        s.start()
    try:
        yield plan, servers, endpoints
    finally:
        for s in servers:
            s.close()


def _client(plan: ShardPlan, endpoint: str, sender: str = "w:0", fragment_bytes: int = FRAGMENT,
            timeout_s: float = 30) -> ShardClient:
    client = ShardClient(experiment="frag", sender=sender, plan=plan, endpoints={0: endpoint},
                         fragment_bytes=fragment_bytes, timeout_s=timeout_s)
    client.hello(fresh=True)
    return client


def _grads(plan: ShardPlan, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {c.index: torch.randn(c.numel, generator=g) for c in plan.chunks}


def test_a_fragmented_push_applies_the_same_bits_as_a_whole_one_with_each_fragment_answered_as_stepped(
        shards: tuple[ShardPlan, list[ShardServer], list[str]]) -> None:
    plan, servers, endpoints = shards
    whole, parted = _client(plan, endpoints[0], fragment_bytes=1 << 30), _client(plan, endpoints[1])
    try:
        for clock in range(3):
            grads = _grads(plan, clock)
            a = whole.push_pull(grads, clock=clock, basis={0: clock})
            b = parted.push_pull(grads, clock=clock, basis={0: clock})
            assert a.versions == b.versions == {0: clock + 1}
            assert sorted(b.values) == sorted(a.values) == [c.index for c in plan.chunks]
            for idx in a.values:
                assert torch.equal(a.values[idx], b.values[idx]), idx
        assert whole.fragments.sent == 0
        assert parted.fragments.sent == 3 * 11
        stats = servers[1].stats()
        # No backup to wait for: every fragment but the last is answered while the rest is stepped.
        assert stats["streamed_answers"] == 3 * 10 and servers[0].stats()["streamed_answers"] == 0
        assert stats["updates"] == 3 and not stats["discarded"]
        # The answers to one push's fragments are one reply held for the connection: a pull right after is served.
        assert parted.pull().versions == {0: 3}
    finally:
        whole.close()
        parted.close()


def test_fragments_sent_again_after_some_arrived_are_gathered_afresh_and_applied_once(
        shards: tuple[ShardPlan, list[ShardServer], list[str]]) -> None:
    plan, servers, endpoints = shards
    client, check = _client(plan, endpoints[0]), _client(plan, endpoints[1], "w:1", fragment_bytes=1 << 30)
    try:
        grads = _grads(plan, 11)
        # The first four fragments of the push its next request will be, as if the rest had been refused.
        reqs = client.pushes.requests(grads, PushRound(clock=0, basis={0: 0}))
        rid = reqs[0].meta["rid"]
        for piece in fragments(reqs[0], FRAGMENT)[:4]:
            client.socks[0].send_multipart(encode(piece))
        # The whole push sent again under the same request id (a resend does that), and answered.
        sent = client.send(reqs)
        res = client.pulls.result(client.collect(sent))
        assert res.versions == {0: 1}
        assert servers[0].stats()["regathered"] == 1
        # Applied once: the same values as the same gradient pushed whole to the twin shard.
        ref = check.push_pull(grads, clock=0, basis={0: 0})
        for idx, v in ref.values.items():
            assert torch.equal(v, res.values[idx]), idx
        assert reqs[0].meta["rid"] == rid
    finally:
        client.close()
        check.close()


def test_a_rejected_fragment_fails_the_push_and_nothing_of_it_is_applied(
        shards: tuple[ShardPlan, list[ShardServer], list[str]]) -> None:
    plan, servers, endpoints = shards
    client = _client(plan, endpoints[0], timeout_s=10)
    try:
        before = client.pull().values
        grads = _grads(plan, 5)
        grads[20][7] = float("nan")  # in the seventh fragment
        with pytest.raises(Exception, match="tensor 'c20' contains NaN or Inf"):
            client.push_pull(grads, clock=0, basis={0: 0})
        after = client.pull()
        # The fragments after the refused one were refused too, not gathered into an update that cannot complete.
        assert servers[0]._updates.gathering == 0
        assert after.versions == {0: 0}
        for idx, v in before.items():
            assert torch.equal(v, after.values[idx]), idx
        # The connection's credit and budget are whole again: the next push goes through.
        assert client.push_pull(_grads(plan, 6), clock=1, basis={0: 0}).versions == {0: 1}
    finally:
        client.close()


class _Reader:
    """A send still reading the live values (`ShardState.lend`) until `done` is set."""

    done = False


def test_only_a_push_s_last_fragment_waits_for_a_reply_still_sending_the_values(
        shards: tuple[ShardPlan, list[ShardServer], list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    plan, servers, endpoints = shards
    server = servers[0]
    monkeypatch.setattr(state_module, "LENT_HOLD_S", 600.0)  # kept back until the reader is done, however slow
    client = _client(plan, endpoints[0])
    try:
        reader = _Reader()
        with server._lock:
            server._state.lend(reader)  # as a reply to another worker still on its way would
        sent = client.send(client.pushes.requests(_grads(plan, 2), PushRound(clock=0, basis={0: 0})))
        deadline = time.monotonic() + 60
        while server.stats()["push_deferrals"] == 0:
            assert time.monotonic() < deadline, "the push's last fragment never came"
            time.sleep(0.02)
        # The ten fragments that say more follow were gathered as they came (in order, before the last): only
        # the last one, which steps the state, is kept back while the values are lent.
        stats = server.stats()
        assert stats["push_deferrals"] == 1 and stats["version"] == 0 and server._updates.gathering == 1
        assert client.socks[0].poll(0) == 0  # not answered yet
        reader.done = True
        res = client.pulls.result(client.collect(sent))
        assert res.versions == {0: 1} and server.stats()["cow_copies"] == 0
    finally:
        client.close()
