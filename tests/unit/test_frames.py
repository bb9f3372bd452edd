"""Wire format: golden header bytes, round trips and a fuzzed decoder that only raises ProtocolError."""

from __future__ import annotations

import pathlib

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossamer.core.errors import ProtocolError
from gossamer.transport.frames import (
    DTYPES,
    WIRE_VERSION,
    ZERO_COPY_THRESHOLD,
    FrameLimits,
    Message,
    check_finite,
    decode,
    encode,
)

GOLDEN = pathlib.Path(__file__).parent.parent / "data" / "header_v1.msgpack"


def golden_message() -> Message:
    return Message(
        op="PUSH",
        experiment="digits",
        shard=1,
        version=7,
        sender="node-a/0",
        meta={"clock": 3, "basis": 6, "rid": 42},
        tensors={
            "c0": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "c5": torch.zeros(4, dtype=torch.bfloat16),
        },
    )


def test_header_matches_golden_vector_v1():
    assert encode(golden_message())[0] == GOLDEN.read_bytes()


def test_golden_vector_decodes_to_documented_fields():
    header = msgpack.unpackb(GOLDEN.read_bytes(), raw=False)
    assert list(header) == [
        "v",
        "op",
        "experiment",
        "shard",
        "version",
        "sender",
        "tensors",
        "meta",
    ]
    assert header["v"] == WIRE_VERSION == 1
    assert header["tensors"][1] == {"name": "c5", "dtype": "bfloat16", "shape": [4]}  # codec "none", no meta


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=shapes,
    seed=st.integers(0, 2**16),
    transpose=st.booleans(),
)
def test_round_trip_is_bit_exact_for_every_dtype_and_shape(dtype, shape, seed, transpose):
    t = _tensor(DTYPES[dtype], shape, seed)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous input
    msg = Message(op="PARAMS", experiment="e", shard=0, version=1, sender="s", tensors={"x": t})
    out = decode(encode(msg))
    got = out.tensors["x"]
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(
        got.contiguous().view(-1).view(torch.uint8) if got.numel() else got,
        t.contiguous().view(-1).view(torch.uint8) if t.numel() else t,
    )


def test_large_tensor_is_sent_zero_copy_and_decoded_writable():
    t = torch.randn(ZERO_COPY_THRESHOLD // 4 + 1)
    frames = encode(Message(op="PUSH", tensors={"g": t}))
    assert isinstance(frames[1], memoryview)
    small = encode(Message(op="PUSH", tensors={"g": torch.randn(ZERO_COPY_THRESHOLD // 4)}))
    assert isinstance(small[1], bytes)
    got = decode([bytes(f) for f in frames]).tensors["g"]
    got.add_(1.0)  # immutable input is copied, so this is safe
    assert torch.equal(got, t + 1.0)


def test_bfloat16_travels_bit_exact():
    t = torch.tensor([1.5, -0.0, float("inf"), 3.0e38], dtype=torch.bfloat16)
    got = decode(encode(Message(op="x", tensors={"b": t}))).tensors["b"]
    assert torch.equal(got.view(torch.int16), t.view(torch.int16))


def _valid_frames() -> list[bytes]:
    return [bytes(f) for f in encode(golden_message())]


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda f: [b"\xc1garbage"] + f[1:], "msgpack"),
        (lambda f: [msgpack.packb([1, 2])] + f[1:], "map"),
        (lambda f: [f[0][:10]] + f[1:], "msgpack"),
        (lambda f: f[:-1], "tensor frames"),
        (lambda f: f[:1] + [f[1][:-4]] + f[2:], "bytes"),
        (lambda f: [f[0].replace(b"bfloat16", b"bfloat17")] + f[1:], "dtype"),
    ],
)
def test_malformed_frames_raise_protocol_error_with_reason(mutate, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(mutate(_valid_frames()))


def _header(**over):
    h = {
        "v": 1,
        "op": "PULL",
        "experiment": "e",
        "shard": 0,
        "version": 0,
        "sender": "s",
        "tensors": [],
        "meta": {},
    }
    h.update(over)
    return [msgpack.packb(h)]


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"v": 2}, "wire version"),
        ({"op": 5}, "'op'"),
        ({"shard": "0"}, "'shard'"),
        ({"meta": []}, "'meta'"),
        ({"tensors": [{"name": "a", "dtype": "float32", "shape": [-1]}]}, "shape"),
        ({"tensors": [{"name": "a", "dtype": "float32", "shape": [2**40, 2**40]}]}, "bytes"),
    ],
)
def test_bad_header_fields_raise_protocol_error(over, needle):
    frames = _header(**over)
    if over.get("tensors"):
        frames.append(b"")
    with pytest.raises(ProtocolError, match=needle):
        decode(frames)


def test_message_over_limit_is_rejected():
    frames = encode(Message(op="PUSH", tensors={"g": torch.zeros(1000)}))
    with pytest.raises(ProtocolError, match="max_message_bytes"):
        decode(frames, FrameLimits(max_message_bytes=1000))


def test_check_finite_names_the_first_bad_tensor():
    msg = Message(
        op="PUSH",
        tensors={
            "ok": torch.ones(3),
            "bad": torch.tensor([1.0, float("nan")]),
            "i": torch.ones(2, dtype=torch.int64),
        },
    )
    with pytest.raises(ProtocolError, match="'bad'"):
        check_finite(msg)
    check_finite(Message(op="PUSH", tensors={"big": torch.full((4,), 3e38)}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=300),
    cut=st.integers(0, 300),
    flip=st.integers(0, 10_000),
    extra=st.lists(st.binary(max_size=64), max_size=3),
)
def test_decoding_random_or_mutated_bytes_only_raises_protocol_error(data, cut, flip, extra):
    valid = _valid_frames()
    head = bytearray(valid[0])
    head[flip % len(head)] ^= 0xFF
    candidates = [
        [data, *extra],
        [valid[0][:cut], *valid[1:]],
        [bytes(head), *valid[1:]],
        [valid[0], *extra],
    ]
    for frames in candidates:
        try:
            decode(frames)
        except ProtocolError:
            pass
