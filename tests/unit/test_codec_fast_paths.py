"""The codecs' fast kernels against their reference paths: int8 without clamp, top-k without sort, PowerSGD's layout, reused wire buffers (with real ZMQ)."""

from __future__ import annotations

import gc
import math
import time

import pytest
import torch
import zmq

from gossamer.compression._kernels import CHUNK
from gossamer.compression.chunk_codec import ChunkCompressor
from gossamer.compression.codec_spec import parse_codec
from gossamer.compression.quantization import INT8_BLOCK, Int8Codec
from gossamer.compression.sparsification import SAMPLED_MIN_NUMEL, topk_count, topk_select
from gossamer.compression.wire_pool import MIN_POOLED, WirePool
from gossamer.engine.shard_plan import ShardPlan
from gossamer.transport import frames
from gossamer.transport.frames import Message

BIG = CHUNK + 777  # past one chunk, not a multiple of a block, a group or a chunk


def _int8_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    zero_blocks = torch.randn(BIG, generator=g)
    zero_blocks[INT8_BLOCK : 3 * INT8_BLOCK] = 0.0
    zero_blocks[CHUNK : CHUNK + INT8_BLOCK] = -0.0
    return {
        "one value": torch.tensor([0.75]),
        "one block less one": torch.randn(INT8_BLOCK - 1, generator=g),
        "one block": torch.randn(INT8_BLOCK, generator=g),
        "one block and one": torch.randn(INT8_BLOCK + 1, generator=g),
        "big with a tail": torch.randn(BIG, generator=g) * 1e-3,
        "zero blocks": zero_blocks,
        "all zeros": torch.zeros(BIG),
        "tail block is zero": torch.cat([torch.randn(CHUNK, generator=g), torch.zeros(100)]),
        "exact block maxima": torch.linspace(-1, 1, 4 * INT8_BLOCK),
    }


@pytest.mark.parametrize("kind", list(_int8_inputs()))
def test_int8_fast_path_is_bit_equal_to_the_whole_tensor_path(kind: str) -> None:
    x = _int8_inputs()[kind]
    codec = Int8Codec()
    fast = codec.encode(x, key="w")
    ref = codec._encode_whole(x)
    assert fast.meta == ref.meta
    assert fast.tensors["absmax"].dtype == ref.tensors["absmax"].dtype
    assert torch.equal(fast.tensors["absmax"], ref.tensors["absmax"])
    assert torch.equal(fast.tensors["q"], ref.tensors["q"])


def test_int8_scales_outside_fp16_and_non_contiguous_inputs_match_the_whole_path() -> None:
    codec = Int8Codec()
    g = torch.Generator().manual_seed(5)
    tiny = torch.randn(BIG, generator=g) * 1e-9  # block maxima under fp16's normal range
    huge = torch.randn(BIG, generator=g)
    huge[CHUNK + 3] = 1e6
    strided = torch.randn(2 * BIG, generator=g)[::2]
    matrix = torch.randn(1024, 2049, generator=g).T  # 0-d and 2-D views go through reshape
    for x in (tiny, huge, strided, matrix, torch.tensor(-2.5)):
        fast = codec.encode(x, key="w")
        ref = codec._encode_whole(x.detach())
        assert torch.equal(fast.tensors["q"], ref.tensors["q"])
        assert torch.equal(fast.tensors["absmax"], ref.tensors["absmax"])


def _topk_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    n = SAMPLED_MIN_NUMEL * 2 + 13
    ties = torch.randint(0, 4, (n,), generator=g).float() - 1.5  # |x| in {0.5, 1.5}: ties at the k-th
    return {
        "ties": ties,
        "big with a tail": torch.randn(BIG, generator=g),
        "fp16": torch.randn(n, generator=g).half(),
        "non-contiguous": torch.randn(2 * n, generator=g)[::2],
        "float64": torch.randn(n, generator=g, dtype=torch.float64),
    }


@pytest.mark.parametrize(
    ("kind", "ratio"),
    [(kind, r) for kind in _topk_inputs() for r in (0.001, 0.1)] + [("big with a tail", 0.01), ("ties", 0.01)],
)
def test_topk_select_returns_exactly_k_increasing_positions_and_their_values(kind: str, ratio: float) -> None:
    """Tolerance on k: none; the set is torch.topk's (ties aside), the values are the entries."""
    x = _topk_inputs()[kind]
    k = topk_count(ratio, x.numel())
    pos, values = topk_select(x, k)
    assert pos.dtype == torch.int64 and pos.numel() == k
    assert bool((pos[1:] > pos[:-1]).all())
    assert values.dtype == x.dtype and torch.equal(values, x[pos])
    kth = torch.topk(x.abs().double(), k).values.min()
    assert bool((values.abs().double() >= kth).all())
    assert int((x.abs().double() > kth).sum()) <= k


def test_topk_finds_nan_and_inf_in_the_tail_after_the_last_group() -> None:
    x = torch.randn(BIG) * 1e-3
    for bad in (math.nan, math.inf):
        x[-1] = bad  # BIG is not a multiple of the group: the last values are the chunk's tail
        with pytest.raises(ValueError, match="NaN or Inf"):
            topk_select(x, topk_count(0.01, BIG))


def test_powersgd_matches_a_float64_power_step_from_the_same_start() -> None:
    g = torch.Generator().manual_seed(2)
    shape = (3000, 517)  # decode blocks of 507 rows: the last one is partial
    m = torch.randn(shape, generator=g) * 1e-2
    codec = parse_codec("powersgd:4")
    got = codec.decode(codec.encode(m, key="w"), shape, torch.float32)
    q0 = torch.randn(517, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p, _ = torch.linalg.qr(m.double() @ q0)
    ref = p @ (p.T @ m.double())
    # fp16 factors: about 2**-11 relative each, on a rank-4 product
    assert float((got.double() - ref).norm() / ref.norm()) < 2e-3
    out = torch.full((math.prod(shape),), math.nan)
    payload = codec.encode(m, key="w")
    into = codec.decode(payload, shape, torch.float32, out=out)
    whole = payload.tensors["p"].float() @ payload.tensors["q"].float().T
    assert torch.equal(into, whole)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8"])
def test_a_reused_wire_buffer_holds_only_the_new_payload(spec: str) -> None:
    codec = parse_codec(spec)
    g = torch.Generator().manual_seed(4)
    first = codec.encode(torch.randn(BIG, generator=g), key="w")
    ptr = first.tensors["q" if spec == "int8" else "values"].data_ptr()
    del first
    for x in (torch.randn(BIG, generator=g) * 1e-3, torch.zeros(BIG)):
        got = codec.encode(x, key="w")
        ref = parse_codec(spec).encode(x)  # a fresh codec: a fresh buffer
        for name, t in ref.tensors.items():
            assert torch.equal(got.tensors[name], t), name
        assert got.tensors["q" if spec == "int8" else "values"].data_ptr() == ptr  # reused
        del got


def test_the_pool_hands_out_a_buffer_only_when_nothing_references_it() -> None:
    pool = WirePool(per_key=2)
    a = pool.take("k", torch.int8, MIN_POOLED)
    a_ptr = a.data_ptr()
    held = a[10:20]  # a view keeps it
    del a
    b = pool.take("k", torch.int8, MIN_POOLED)
    assert b.data_ptr() != a_ptr
    c = pool.take("k", torch.int8, MIN_POOLED)  # both pooled ones are busy: a new one
    assert c.data_ptr() not in (a_ptr, b.data_ptr())
    del held, c
    assert pool.take("k", torch.int8, MIN_POOLED).data_ptr() == a_ptr
    a = pool.take("k", torch.int8, MIN_POOLED)  # holds the first buffer from here on
    storage = b.untyped_storage()  # the storage object alone keeps the second
    b_ptr = b.data_ptr()
    del b
    assert pool.take("k", torch.int8, MIN_POOLED).data_ptr() not in (a_ptr, b_ptr)
    del storage
    assert pool.take("k", torch.int8, MIN_POOLED).data_ptr() == b_ptr
    array = pool.take("k", torch.int8, MIN_POOLED).numpy()  # and so does a numpy array of it
    assert array.ctypes.data == b_ptr
    assert pool.take("k", torch.int8, MIN_POOLED).data_ptr() not in (a_ptr, b_ptr)
    del array
    assert pool.take("k", torch.int8, MIN_POOLED).data_ptr() == b_ptr
    assert a.data_ptr() == a_ptr
    # No key, a small size, a new size: never pooled or the old buffers dropped.
    # (pointers taken apart: pytest's assert rewriting keeps the tensors of an assert alive)
    reused = pool.reused
    pool.take(None, torch.int8, MIN_POOLED)
    pool.take("k", torch.int8, MIN_POOLED - 1)
    assert pool.reused == reused
    first = pool.take("k", torch.int8, MIN_POOLED + 1).data_ptr()
    again = pool.take("k", torch.int8, MIN_POOLED + 1).data_ptr()
    assert first == again and pool.reused == reused + 1


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        gc.collect()
        time.sleep(0.01)


def test_a_buffer_zmq_still_sends_is_never_rewritten() -> None:
    """A payload sent zero-copy and not yet read by the peer: the next encodes of the key get
    other buffers, and the peer receives the first payload's bytes unchanged; once ZMQ has
    let go of the frame, the buffer is reused."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://wire-pool")
        push.connect("inproc://wire-pool")
        codec = parse_codec("fp16")
        g = torch.Generator().manual_seed(8)
        payload = codec.encode(torch.randn(BIG, generator=g), key="w")
        sent = payload.tensors["values"].clone()
        ptr = payload.tensors["values"].data_ptr()
        msg_frames = frames.encode(Message(op="PUSH", tensors=payload.tensors))
        assert isinstance(msg_frames[1], memoryview)  # zero-copy: ZMQ references the buffer
        tracker = push.send_multipart(msg_frames, copy=False, track=True)
        del payload, msg_frames
        gc.collect()
        others = []
        for _ in range(3):  # the pool's other slot, then new buffers: never the one in flight
            p = codec.encode(torch.randn(BIG, generator=g), key="w")
            assert p.tensors["values"].data_ptr() != ptr
            others.append(p)
        assert not tracker.done
        got = frames.decode(pull.recv_multipart(copy=True))
        assert torch.equal(got.tensors["values"], sent)
        _wait(lambda: tracker.done, "libzmq to release the frame")
        del others, p
        _wait(lambda: codec.encode(torch.zeros(BIG), key="w").tensors["values"].data_ptr() == ptr,
              "the released buffer to be reused")
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("spec", ["fp16", "int8"])
def test_released_buffers_are_not_reused_and_a_chunk_compressor_releases_every_codecs(spec: str) -> None:
    codec = parse_codec(spec)
    x = torch.randn(1 << 18)
    pool = codec._pool  # type: ignore[attr-defined]
    codec.encode(x, key="k")
    codec.encode(x, key="k")  # the first payload was dropped: its buffer serves again
    assert pool.reused == 1
    codec.release_buffers()
    codec.encode(x, key="k")
    assert pool.reused == 1  # a fresh buffer: nothing was kept
    cc = ChunkCompressor(spec, ShardPlan.build([("w", 1 << 18)], num_shards=1, chunk_numel=1 << 20))
    cc.encode(0, x)
    inner = next(iter(cc._codecs.values()))._pool  # type: ignore[attr-defined]
    assert inner._bufs  # kept for the next encode
    cc.release_buffers()
    assert not inner._bufs
