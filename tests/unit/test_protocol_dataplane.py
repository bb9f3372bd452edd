"""Data-plane op metadata: typed on both sides, the same msgpack maps on the wire, bad fields named."""

from __future__ import annotations

import dataclasses

import pytest

from gossamer.core.errors import ProtocolError
from gossamer.core.protocol import (
    CancelMeta,
    HelloMeta,
    MassMeta,
    ParamsMeta,
    PullMeta,
    PushCompression,
    PushMeta,
    ReplicateMeta,
    SnapMeta,
    SnapshotMeta,
    SyncMeta,
    chunk_key,
    parse_chunk_key,
)
from gossamer.transport.frames import encode
from tests.unit.test_frames import GOLDEN, golden_message


def test_a_typed_push_encodes_to_the_golden_vector() -> None:
    msg = dataclasses.replace(golden_message(), meta={**PushMeta(clock=3, basis=6).to_meta(), "rid": 42})
    assert encode(msg)[0] == GOLDEN.read_bytes()


@pytest.mark.parametrize("meta", [
    HelloMeta(fresh=True),
    PullMeta(chunks=(0, 3), pull_codec="topk:0.1"),
    PullMeta(),
    PushMeta(clock=4, basis=2, pull_codec="int8", step=2, num_workers=3, generation=1),
])
def test_request_meta_round_trips(meta: HelloMeta | PullMeta | PushMeta) -> None:
    if isinstance(meta, PushMeta):
        assert PushMeta.from_meta(meta.to_meta(), barrier=True) == meta
    else:
        assert type(meta).from_meta(meta.to_meta()) == meta


def test_an_async_push_carries_no_barrier_fields() -> None:
    meta = PushMeta(clock=1, basis=0).to_meta()
    assert meta == {"clock": 1, "basis": 0}
    assert PushMeta.from_meta({**meta, "step": "junk"}, barrier=False).step is None


@pytest.mark.parametrize(("decode", "meta", "field"), [
    (lambda m: PushMeta.from_meta(m, barrier=False), {"clock": -1, "basis": 0}, "clock"),
    (lambda m: PushMeta.from_meta(m, barrier=False), {"clock": 1, "basis": True}, "basis"),
    (lambda m: PushMeta.from_meta(m, barrier=True), {"clock": 1, "basis": 0, "step": 0, "num_workers": 0},
     "num_workers"),
    (lambda m: PushMeta.from_meta(m, barrier=True), {"clock": 1, "basis": 0, "step": 0, "num_workers": 1, "generation": -2},
     "generation"),
    (lambda m: PushMeta.from_meta(m, barrier=False), {"clock": 1, "basis": 0, "pull_codec": 7}, "pull_codec"),
    (PullMeta.from_meta, {"chunks": [1, "2"]}, "chunks"),
    (HelloMeta.from_meta, {"fresh": "yes"}, "fresh"),
    (PushCompression.from_meta, {"compression": {}}, "compression"),
    (PushCompression.from_meta, {"compression": {"0": {}}, "codec": "int8", "codec_overrides": [["a"]]},
     "codec_overrides"),
    (ParamsMeta.from_meta, {"done": 1}, "done"),
    (ReplicateMeta.from_meta, {"lr_factor": "1"}, "lr_factor"),
    (SyncMeta.from_meta, {"applied": [], "scalars": {}}, "applied"),
])
def test_a_bad_field_is_a_protocol_error_naming_it(decode, meta, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProtocolError, match=field):
        decode(meta)


def test_compression_and_state_meta_round_trip() -> None:
    comp = PushCompression(chunks={"0": {"k": 3}}, codec="topk:0.1", overrides=(("fc*", "int8"),))
    assert PushCompression.from_meta(comp.to_meta()) == comp
    assert PushCompression.from_meta({"clock": 1}) is None
    sync = SyncMeta(state_version=5, applied={"w": 4}, scalars={"0/step": 5.0})
    assert SyncMeta.from_meta(sync.to_meta()) == sync
    rep = ReplicateMeta(lr_factor=0.5, applied=(("w", 3),))
    assert ReplicateMeta.from_meta(rep.to_meta()) == rep


def test_chunk_keys_round_trip_and_refuse_other_names() -> None:
    assert parse_chunk_key(chunk_key(12)) == 12
    for bad in ("c", "x1", "c-1", "c1/m", "c" + "9" * 12):
        with pytest.raises(ProtocolError):
            parse_chunk_key(bad)


def test_gossip_meta_round_trips_and_names_a_bad_field() -> None:
    mass = MassMeta(id=3, inc=9, gen=1, step=4, weight=0.5, codec="int8", payload={"scale": 1.0})
    assert MassMeta.from_meta(mass.to_meta()) == mass
    assert CancelMeta.from_meta(CancelMeta(id=3, inc=9).to_meta()) == CancelMeta(id=3, inc=9)
    assert SnapMeta.from_meta({"rid": 1, **SnapMeta(light=True).to_meta()}).light
    assert SnapMeta.from_meta({"rid": 1, **SnapMeta(half=True).to_meta()}) == SnapMeta(half=True)
    assert SnapMeta().to_meta() == {"light": False}  # a peer from before `half` reads the same request
    assert not SnapMeta.from_meta({"rid": 1, "half": "yes"}).half
    snap = SnapshotMeta(weight=1.0, step=7, done=False, gen=2)
    assert SnapshotMeta.from_meta(snap.to_meta()) == snap
    for decode, meta, field in [
        (MassMeta.from_meta, {**mass.to_meta(), "inc": None}, "inc"),
        (MassMeta.from_meta, {**mass.to_meta(), "weight": "1"}, "weight"),
        (CancelMeta.from_meta, {"id": 1}, "inc"),
        (SnapMeta.from_meta, {"light": True}, "rid"),
        (SnapshotMeta.from_meta, {**snap.to_meta(), "weight": float("inf")}, "weight"),
    ]:
        with pytest.raises(ProtocolError, match=field):
            decode(meta)  # type: ignore[operator]


def test_replicate_meta_carries_forwarded_push_compressions_and_names_a_bad_part() -> None:
    part = PushCompression(chunks={"0": {"v": 1}}, codec="topk:0.01")
    rep = ReplicateMeta(lr_factor=0.25, applied=(("a", 1), ("b", 2)), delay=3, parts=(part, part))
    assert ReplicateMeta.from_meta(rep.to_meta()) == rep
    assert "parts" not in ReplicateMeta(lr_factor=1.0).to_meta()  # a dense REPLICATE's meta is unchanged
    for bad in ({"parts": {}}, {"parts": [{"codec": "int8"}]}, {"parts": [{"compression": {}, "codec": "int8"}]},
                {"parts": [7]}):
        with pytest.raises(ProtocolError, match="parts"):
            ReplicateMeta.from_meta({"lr_factor": 1.0, **bad})
