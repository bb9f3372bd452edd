"""The codecs' chunked kernels at sizes past one chunk: sampled top-k, fused finiteness checks, decode into a buffer."""

from __future__ import annotations

import math

import pytest
import torch

from gossamer.compression._kernels import CHUNK, Scratch, pack_signs
from gossamer.compression.codec_spec import parse_codec
from gossamer.compression.error_feedback import ErrorFeedback
from gossamer.compression.sign import pack_bits
from gossamer.compression.sparsification import SAMPLED_MIN_NUMEL, topk_count, topk_indices
from gossamer.core.errors import ProtocolError

# Past two chunks and not a multiple of a block, a byte or a chunk: every tail path runs.
BIG = 2 * CHUNK + 777


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = SAMPLED_MIN_NUMEL * 2 + 13
    sparse = torch.randn(n, generator=g)
    sparse[torch.rand(n, generator=g) < 0.9] = 0.0
    return {
        "normal": torch.randn(n, generator=g),
        "heavy tail": torch.randn(n, generator=g) ** 5,
        "positive": torch.rand(n, generator=g),
        "mostly zero": sparse,
        # Large values only where a stride-100 sample never looks: the estimate is wrong and
        # the selection has to notice and fall back.
        "hidden from the sample": torch.where(
            torch.arange(n) % 100 == 50, torch.full((n,), 10.0), torch.randn(n, generator=g) * 1e-3
        ),
    }


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("kind", list(_inputs()))
def test_sampled_topk_keeps_exactly_k_and_the_same_entries_as_torch_topk(kind: str, ratio: float) -> None:
    """Tolerance on k: none. The sampled threshold only changes the cost, never the set."""
    x = _inputs()[kind]
    k = topk_count(ratio, x.numel())
    got = topk_indices(x, k, Scratch())
    assert got.numel() == k
    assert bool((got[1:] > got[:-1]).all())
    kth = torch.topk(x.abs(), k).values.min()
    # Every kept entry is at least the k-th largest magnitude, so (ties aside) the same set.
    assert bool((x[got].abs() >= kth).all())
    assert int((x.abs() > kth).sum()) <= k


def test_sampled_topk_with_error_feedback_carries_the_remainder_exactly() -> None:
    codec = parse_codec("topk:0.01")
    ef = ErrorFeedback()
    g = torch.Generator().manual_seed(3)
    n = SAMPLED_MIN_NUMEL * 3
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(5):
        grad = torch.randn(n, generator=g) * 1e-2
        total += grad.double()
        compensated = ef.compensate("w", grad)
        decoded = codec.decode(codec.encode(compensated), (n,), torch.float32)
        assert int((decoded != 0).sum()) <= topk_count(0.01, n)
        ef.update("w", compensated, decoded)
        residual = ef.residual("w")
        assert residual is not None
        # What was not sent is exactly what is kept: decoded + residual == compensated.
        assert torch.equal(decoded + residual, compensated)
        sent += decoded.double()
    assert torch.allclose(sent + residual.double(), total, atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "sign", "topk:0.01", "randk:0.01", "powersgd:2", "qsgd:8"])
def test_decode_into_a_buffer_equals_a_fresh_decode(spec: str) -> None:
    shape = (BIG // 1024, 1024) if spec.startswith("powersgd") else (BIG,)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e-2
    codec = parse_codec(spec, seed=0)
    payload = codec.encode(x, key="w")
    fresh = codec.decode(payload, shape, torch.float32)
    out = torch.full((math.prod(shape),), math.nan)
    into = codec.decode(payload, shape, torch.float32, out=out)
    assert into.data_ptr() == out.data_ptr()
    assert torch.equal(into, fresh)
    assert bool((fresh - x).abs().double().le(codec.error_bound(x)).all())


@pytest.mark.parametrize("spec", ["none", "fp16", "int8"])
def test_decode_refuses_an_out_buffer_that_does_not_fit(spec: str) -> None:
    codec = parse_codec(spec)
    payload = codec.encode(torch.ones(10))
    for bad in (torch.empty(9), torch.empty(10, dtype=torch.float64), torch.empty(20)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            codec.decode(payload, (10,), torch.float32, out=bad)
    with pytest.raises(ValueError, match="out must be"):
        codec.decode(payload, (10,), torch.float16, out=torch.empty(10))


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "sign", "topk:0.01", "powersgd:2"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, CHUNK + 5, BIG - 1])
def test_encode_finds_nan_and_inf_in_any_chunk(spec: str, bad: float, where: int) -> None:
    x = torch.randn(BIG) * 1e-2
    x[where] = bad
    shape = (BIG // 1024, 1024) if spec.startswith("powersgd") else (BIG,)
    if spec.startswith("powersgd"):
        x = x[: math.prod(shape)].reshape(shape)
        x.view(-1)[min(where, x.numel() - 1)] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        parse_codec(spec).encode(x)


def test_int8_decode_refuses_minus_128_past_the_first_chunk() -> None:
    codec = parse_codec("int8")
    payload = codec.encode(torch.randn(BIG))
    payload.tensors["q"][CHUNK + 3] = -128
    with pytest.raises(ProtocolError, match="-128"):
        codec.decode(payload, (BIG,), torch.float32, out=torch.empty(BIG))


def test_large_magnitudes_take_the_careful_path_not_an_error() -> None:
    x = torch.randn(BIG)
    x[CHUNK + 1] = 1e30  # past fp16 and past an fp16 int8 scale, yet finite
    for spec in ("fp16", "int8", "sign"):
        codec = parse_codec(spec)
        decoded = codec.decode(codec.encode(x), (BIG,), torch.float32)
        assert bool((decoded - x).abs().double().le(codec.error_bound(x)).all()), spec


@pytest.mark.parametrize("spiky", [False, True])
def test_sign_scale_is_the_rms_capped_at_one_and_a_half_means_rounded_down_within_2_to_minus_17(spiky: bool) -> None:
    x = torch.rand(BIG) * 3  # rms sqrt(3) below 1.5 x the mean 1.5: the rms
    if spiky:
        x[::97] = 1e3  # rms far above 1.5 x the mean: the cap
    scale = float(parse_codec("sign").encode(x).tensors["scale"])
    wide = x.double()
    rms, mean = float(wide.pow(2).mean().sqrt()), float(wide.abs().mean())
    want = 1.5 * mean if spiky else rms
    assert (rms > 1.5 * mean) == spiky
    assert want * (1 - 2.0**-17) <= scale <= want


def test_packed_signs_match_the_reference_packing() -> None:
    x = torch.randn(CHUNK + 13)
    assert torch.equal(pack_signs(x, Scratch()), pack_bits(x >= 0))
