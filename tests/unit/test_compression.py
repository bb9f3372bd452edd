"""Compression codecs: error bounds, error feedback, QSGD unbiasedness, sizes, strict decoding."""

from __future__ import annotations

import math
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossamer.compression import (
    CODECS,
    WIRE_DTYPES,
    ChunkCompressor,
    Codec,
    CodecEntry,
    ErrorFeedback,
    Payload,
    QSGDCodec,
    parse_codec,
)
from gossamer.compression.codec_spec import codec_class
from gossamer.compression.quantization import QSGD_BUCKET
from gossamer.compression.randk import positions
from gossamer.core.codec_table import IntArg, RatioArg
from gossamer.core.errors import ConfigError, ProtocolError
from gossamer.engine.shard_plan import ShardPlan
from gossamer.transport.frames import Message
from gossamer.transport.frames import decode as decode_frames
from gossamer.transport.frames import encode as encode_frames

#: Every codec of the registry, through its example specs: a new registry line is tested here.
SPECS = [spec for entry in CODECS for spec in entry.examples]


def every_codec(specs: list[str], where: Callable[[CodecEntry], bool] = lambda e: True) -> list[str]:
    """`specs`, plus the first example of every registry codec matching `where` not among them."""
    named = {s.partition(":")[0] for s in specs}
    return specs + [e.examples[0] for e in CODECS if where(e) and e.name not in named]


INPUT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Half-ulp of rounding a decoded fp32 value into the output dtype: (relative, absolute).
OUTPUT_ROUNDING = {
    torch.float32: (0.0, 0.0),
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 40), min_size=1, max_size=2).map(tuple),
    st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5)),
)
scales = st.sampled_from(["normal", "zeros", "tiny", "huge", "mixed", "constant"])
layouts = st.sampled_from(["contiguous", "transposed", "strided"])


def make_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, scale: str, seed: int, layout: str
) -> torch.Tensor:
    """Finite values of `dtype` with the given magnitudes, laid out (non-)contiguously."""
    g = torch.Generator().manual_seed(seed)
    base_shape = shape
    if layout == "transposed" and len(shape) >= 2:
        base_shape = shape[::-1]
    elif layout == "strided" and len(shape) >= 1:
        base_shape = (shape[0] * 2, *shape[1:])
    x = torch.randn(base_shape, generator=g, dtype=torch.float64)
    if scale == "zeros":
        x.zero_()
    elif scale == "tiny":
        x *= 1e-30
    elif scale == "huge":
        x *= 1e30
    elif scale == "mixed":
        x *= 10.0 ** (torch.rand(base_shape, generator=g, dtype=torch.float64) * 60 - 30)
    elif scale == "constant":
        x = torch.full(base_shape, -3.5, dtype=torch.float64)
    top = torch.finfo(dtype).max
    x = x.clamp(-top, top).to(dtype)
    if layout == "transposed" and len(shape) >= 2:
        x = x.permute(*reversed(range(len(shape))))
    elif layout == "strided" and len(shape) >= 1:
        x = x[::2]
    assert tuple(x.shape) == shape
    return x


def within_bound(codec: Codec, x: torch.Tensor, y: torch.Tensor) -> tuple[bool, float]:
    """Whether y = decode(encode(x)) (in x's dtype) is within the codec's documented bound."""
    bound = codec.error_bound(x)
    rel, tiny = OUTPUT_ROUNDING[x.dtype]
    xd = x.double()
    tol = bound + (xd.abs() + bound) * rel + tiny
    err = (y.double() - xd).abs()
    worst = float((err - tol).max()) if err.numel() else 0.0
    return bool((err <= tol).all()), worst


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@FAST
@given(
    shape=shapes,
    dtype=st.sampled_from(INPUT_DTYPES),
    scale=scales,
    layout=layouts,
    seed=st.integers(0, 2**31),
)
def test_every_codec_round_trips_within_its_documented_error_bound(
    spec, shape, dtype, scale, layout, seed
):
    codec = parse_codec(spec, seed=seed)
    x = make_tensor(shape, dtype, scale, seed, layout)
    before = x.clone()
    payload = codec.encode(x, key="k")
    assert torch.equal(x, before), "encode modified its input"
    for t in payload.tensors.values():
        assert t.dtype in WIRE_DTYPES and t.is_contiguous()
    msgpack.packb(payload.meta)  # meta is msgpack-safe
    y = codec.decode(payload, shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    ok, worst = within_bound(codec, x, y)
    assert ok, f"{spec}: error exceeds the bound by {worst}"


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@FAST
@given(shape=shapes, scale=scales, layout=layouts, seed=st.integers(0, 2**31))
def test_cast_codecs_are_exact_for_values_representable_on_the_wire(
    spec, dtype, shape, scale, layout, seed
):
    codec = parse_codec(spec)
    wire = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec]
    x = make_tensor(shape, dtype, scale, seed, layout)
    top = min(torch.finfo(wire).max, torch.finfo(dtype).max) / 2
    x = x.double().clamp(-top, top).to(wire).to(dtype)
    x = torch.where(x.to(wire).to(dtype) == x, x, torch.zeros_like(x))  # representable in both
    assert torch.equal(codec.decode(codec.encode(x), shape, dtype), x)


def test_fp16_clamps_values_beyond_its_range_instead_of_sending_inf():
    codec = parse_codec("fp16")
    y = codec.decode(codec.encode(torch.tensor([1e30, -1e30, 1.0])), (3,), torch.float32)
    assert y.tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("spec", SPECS)
def test_encode_refuses_non_finite_values(spec):
    with pytest.raises(ValueError):
        parse_codec(spec).encode(torch.tensor([1.0, math.nan, 2.0]))
    with pytest.raises(ValueError):
        parse_codec(spec).encode(torch.tensor([1, 2]))


def test_powersgd_sends_small_or_one_dimensional_tensors_uncompressed_and_exact():
    codec = parse_codec("powersgd:4")
    for shape in [(100,), (4, 4), (3, 500), (8, 8)]:
        x = torch.randn(shape)
        p = codec.encode(x)
        assert set(p.tensors) == {"values"} and p.meta == {"rank": 0}
        assert torch.equal(codec.decode(p, shape, torch.float32), x)
    p = codec.encode(torch.randn(64, 3, 3))  # viewed as 64 x 9: rank 4 costs 4*73 < 576
    assert p.tensors["p"].shape == (64, 4) and p.tensors["q"].shape == (9, 4)


def test_powersgd_is_exact_on_a_matrix_of_lower_rank_and_warm_start_improves_the_fit():
    g = torch.Generator().manual_seed(0)
    low = torch.randn(60, 2, generator=g) @ torch.randn(2, 50, generator=g)
    codec = parse_codec("powersgd:2")
    y = codec.decode(codec.encode(low, key="w"), (60, 50), torch.float32)
    # exact up to the fp16 rounding of the factors (2**-11 relative per factor entry)
    assert float((y - low).norm() / low.norm()) < 2e-3
    m = torch.randn(60, 50, generator=g)
    errs = []
    for _ in range(6):
        errs.append(
            float((codec.decode(codec.encode(m, key="m"), (60, 50), torch.float32) - m).norm())
        )
    assert errs[-1] < errs[0]


# --- error feedback -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", every_codec(["topk:0.05", "sign", "powersgd:1", "int8"], lambda e: e.error_feedback)
)
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    steps=st.integers(1, 6),
    shape=st.sampled_from([(37,), (12, 20), (1,), (0,)]),
)
def test_error_feedback_keeps_sum_of_decoded_plus_residual_equal_to_sum_of_inputs(
    spec, seed, steps, shape
):
    codec = parse_codec(spec, seed=seed)
    ef = ErrorFeedback()
    g = torch.Generator().manual_seed(seed)
    sent = torch.zeros(shape, dtype=torch.float64)
    total = torch.zeros(shape, dtype=torch.float64)
    magnitude = torch.zeros(shape, dtype=torch.float64)
    for _ in range(steps):
        grad = torch.randn(shape, generator=g)
        comp = ef.compensate("k", grad)
        decoded = codec.decode(codec.encode(comp, key="k"), shape, torch.float32)
        ef.update("k", comp, decoded)
        sent += decoded.double()
        total += grad.double()
        magnitude += grad.double().abs() + decoded.double().abs()
    residual = ef.residual("k")
    assert residual is not None and residual.dtype == torch.float32
    # Each step rounds (g + e) and (g + e) - decoded in fp32: a few ulps of the magnitudes.
    assert bool(((sent + residual.double() - total).abs() <= 2e-6 * (1 + magnitude)).all())


def test_error_feedback_lets_topk_eventually_send_every_coordinate():
    codec, ef = parse_codec("topk:0.1"), ErrorFeedback()
    grad = torch.linspace(1, 2, 50)
    touched = torch.zeros(50, dtype=torch.bool)
    for _ in range(30):
        comp = ef.compensate("k", grad)
        decoded = codec.decode(codec.encode(comp), (50,), torch.float32)
        ef.update("k", comp, decoded)
        touched |= decoded != 0
    assert bool(touched.all())


def test_error_feedback_rejects_a_gradient_of_another_shape():
    ef = ErrorFeedback()
    ef.update("k", torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError):
        ef.compensate("k", torch.ones(4))


# --- QSGD -----------------------------------------------------------------------------------


def _bucket_norms(x: torch.Tensor) -> torch.Tensor:
    """Each element's QSGD bucket norm (float64), in `x`'s flat order."""
    flat = x.reshape(-1).double()
    pad = -flat.numel() % QSGD_BUCKET
    norms = torch.cat([flat, flat.new_zeros(pad)]).view(-1, QSGD_BUCKET).norm(dim=1)
    return norms.repeat_interleave(QSGD_BUCKET)[: flat.numel()]


@pytest.mark.parametrize("levels", [1, 4])
def test_qsgd_is_unbiased_mean_of_many_decodes_matches_the_vector(levels):
    # Three buckets (the last one short) whose scales differ by 10**4: each element's noise is
    # its own bucket's, so the small buckets' means must be as precise as their norms allow.
    n = 2 * QSGD_BUCKET + 76
    x = torch.randn(n, generator=torch.Generator().manual_seed(7)) * torch.logspace(-3, 1, n)
    codec = QSGDCodec(levels, seed=1234)
    draws = 2000
    acc = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws):
        acc += codec.decode(codec.encode(x), (n,), torch.float32).double()
    mean = acc / draws
    # Each draw is norm/L * (floor or floor+1), norm its bucket's: per-coordinate std <= norm / (2 L).
    sigma_of_mean = _bucket_norms(x) / levels / 2 / math.sqrt(draws)
    z = ((mean - x.double()).abs() / sigma_of_mean).max()
    assert z < 5.0, f"max |z| = {z:.2f}"


@pytest.mark.parametrize("levels", [16, 127])
def test_qsgd_relative_variance_is_bounded_by_the_bucket_not_the_tensor_size(levels):
    # A whole-tensor norm gives variance up to sqrt(d) / L * |x|**2: ~5x the signal at a million
    # values and L = 127. Per bucket of B it is at most min(B / L**2, sqrt(B) / L), any d.
    bound = min(QSGD_BUCKET / levels**2, math.sqrt(QSGD_BUCKET) / levels)
    codec = QSGDCodec(levels, seed=5)
    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(1_000_000, generator=g), torch.randn(1_000_000, generator=g) * torch.logspace(-4, 2, 1_000_000)):
        y = codec.decode(codec.encode(x), tuple(x.shape), torch.float32)
        rel = float((y.double() - x.double()).norm() ** 2 / x.double().norm() ** 2)
        assert rel <= bound, f"relative squared error {rel:.3g} > {bound:.3g}"


def test_qsgd_errors_are_bounded_by_their_own_bucket():
    # One loud bucket beside a quiet one: the quiet bucket's values keep its own precision.
    x = torch.cat([torch.randn(QSGD_BUCKET) * 1e4, torch.randn(QSGD_BUCKET)])
    codec = QSGDCodec(127, seed=9)
    err = (codec.decode(codec.encode(x), tuple(x.shape), torch.float32) - x).abs().double()
    quiet = float(x[QSGD_BUCKET:].double().norm())
    assert float(err[QSGD_BUCKET:].max()) <= quiet / 127 * (1 + 2.0**-18) + 1e-6
    assert bool((err <= codec.error_bound(x)).all())
    assert torch.allclose(codec.error_bound(x)[QSGD_BUCKET:], _bucket_norms(x)[QSGD_BUCKET:] / 127, rtol=1e-5)


def test_qsgd_payload_matches_the_golden_vector():
    # Values whose |x| / norm * L are whole numbers: the levels are exact, whatever the draws.
    x = torch.zeros(2 * QSGD_BUCKET + 2)
    x[:7] = torch.tensor([1.0, -1.0, 1.0, 1.0, 2.0, -2.0, 2.0])  # norm 4: levels 1 and 2 at L = 4
    x[-1] = -3.0  # the second bucket is all zeros; the third (short) one has norm 3
    p = QSGDCodec(4, seed=0).encode(x)
    assert p.meta == {"levels": 4, "bucket": 512}
    assert p.tensors["norm"].dtype == torch.float32 and p.tensors["norm"].tolist() == [4.0, 0.0, 3.0]
    levels = torch.zeros(x.numel(), dtype=torch.int8)
    levels[:7] = torch.tensor([1, -1, 1, 1, 2, -2, 2], dtype=torch.int8)
    levels[-1] = -4
    assert torch.equal(p.tensors["levels"], levels)
    assert torch.equal(QSGDCodec(4).decode(p, tuple(x.shape), torch.float32), x)
    assert QSGDCodec(4)._payload_bytes(tuple(x.shape)) == x.numel() + 4 * 3


def test_qsgd_with_a_seed_is_reproducible():
    x = torch.randn(100)
    a = QSGDCodec(4, seed=3).encode(x).tensors["levels"]
    b = QSGDCodec(4, seed=3).encode(x).tensors["levels"]
    assert torch.equal(a, b)


# --- sizes ----------------------------------------------------------------------------------


def test_topk_payload_holds_only_kept_indices_and_values():
    x = torch.randn(100_000)
    p = parse_codec("topk:0.01").encode(x)
    assert p.tensors["indices"].dtype == torch.int32 and p.tensors["values"].dtype == torch.float16
    assert p.tensors["indices"].numel() == p.tensors["values"].numel() == 1000
    assert p.nbytes == 1000 * (4 + 2)
    kept = x.abs().sort(descending=True).values[:1000]
    assert torch.equal(p.tensors["values"].abs().sort(descending=True).values, kept.half())
    small = parse_codec("topk:0.01").encode(torch.randn(30_000))
    assert small.tensors["indices"].dtype == torch.int16  # 2-byte indices below 32768 entries
    huge = parse_codec("topk:0.01").encode(torch.randn(30_000) * 1e6)
    assert huge.tensors["values"].dtype == torch.float32  # out of fp16 range: exact fp32


def test_nominal_ratios_meet_the_targets():
    assert parse_codec("int8").nominal_ratio(1 << 20) >= 3.9
    assert parse_codec("topk:0.01").nominal_ratio(100_000) >= 50
    assert parse_codec("powersgd:4").nominal_ratio(512 * 512, (512, 512)) >= 50
    assert parse_codec("sign").nominal_ratio(1 << 20) >= 31
    assert parse_codec("fp16").nominal_ratio(10) == parse_codec("bf16").nominal_ratio(10) == 2


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1000,), (40, 25), (1,)])
def test_nominal_ratio_equals_real_payload_ratio(spec, shape):
    codec = parse_codec(spec)
    p = codec.encode(torch.randn(shape))
    assert codec.nominal_ratio(math.prod(shape), shape) == pytest.approx(
        4 * math.prod(shape) / p.nbytes
    )


# --- specs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "zip",
        "topk",
        "topk:0",
        "topk:1.5",
        "topk:nan",
        "topk:x",
        "qsgd:0",
        "qsgd:128",
        "qsgd:-1",
        "powersgd:0",
        "powersgd:1.5",
        "int8:2",
        "fp16:1",
        None,
    ],
)
def test_bad_specs_raise_config_error_naming_the_field(spec):
    with pytest.raises(ConfigError) as e:
        parse_codec(spec, field="compression")
    assert e.value.field == "compression"


def test_specs_are_canonical():
    assert parse_codec(" topk:0.010 ").spec == "topk:0.01"
    for spec in SPECS:
        assert parse_codec(spec).spec == spec or spec == "topk:1"


# --- the registry ---------------------------------------------------------------------------


@pytest.mark.parametrize("entry", CODECS, ids=lambda e: e.name)
def test_every_registry_line_names_its_class_and_canonical_examples(entry: CodecEntry) -> None:
    cls = codec_class(entry)
    assert issubclass(cls, Codec) and cls.name == entry.name
    assert entry.examples and all(s.partition(":")[0] == entry.name for s in entry.examples)
    for spec in entry.examples:
        codec = parse_codec(spec)
        assert isinstance(codec, cls) and codec.biased == entry.error_feedback
        assert parse_codec(codec.spec).spec == codec.spec  # the canonical spec parses back


def _arg_cases(entry: CodecEntry) -> tuple[list[str], list[str]]:
    """(arguments the grammar accepts, arguments it refuses) for an entry that takes one."""
    if isinstance(entry.arg, IntArg):
        good = [str(entry.arg.lo), str(min(entry.arg.hi, 999_999_999))]
        bad = [str(entry.arg.lo - 1), "", "-1", "1.5", "²", "٣", "0000000001", " 1", "1e3"]
        if entry.arg.hi < 999_999_999:
            bad.append(str(entry.arg.hi + 1))
        return good, bad
    assert isinstance(entry.arg, RatioArg)
    return (["1", "1.0", "0.5", ".5", "1e-3", "5E-1", "0.25e+0"],
            ["0", "0.0", "1.5", "1e3", "-0.5", "+0.5", "nan", "inf", "1_0", "0x1", " 0.5", "", "1" * 40])


@pytest.mark.parametrize("entry", [e for e in CODECS if e.arg is not None], ids=lambda e: e.name)
def test_argument_grammar_bounds_agree_with_the_codec_class(entry: CodecEntry) -> None:
    good, bad = _arg_cases(entry)
    for arg in good:
        assert parse_codec(f"{entry.name}:{arg}").name == entry.name
    for arg in bad:
        with pytest.raises(ConfigError) as e:
            parse_codec(f"{entry.name}:{arg}", field="pull_compression")
        assert e.value.field == "pull_compression"
    with pytest.raises(ConfigError):
        parse_codec(entry.name)  # the argument is required
    if isinstance(entry.arg, IntArg) and entry.arg.hi < 999_999_999:
        # The class refuses beyond the grammar too, when built directly.
        with pytest.raises(ConfigError):
            codec_class(entry).from_arg(entry.arg.hi + 1)


@pytest.mark.parametrize("entry", [e for e in CODECS if e.arg is None], ids=lambda e: e.name)
def test_codecs_without_argument_refuse_one(entry: CodecEntry) -> None:
    with pytest.raises(ConfigError, match="takes no argument"):
        parse_codec(f"{entry.name}:1")


@pytest.mark.parametrize("entry", CODECS, ids=lambda e: e.name)
def test_elementwise_codecs_share_one_payload_across_parameters(entry: CodecEntry) -> None:
    segs = ChunkCompressor(entry.examples[0], plan(10_000), shapes=SHAPES).segments(0)
    assert (len(segs) == 1) == entry.elementwise


def test_registry_and_experiment_validation_import_without_torch() -> None:
    code = (
        "import sys, gossamer.core.codec_table, gossamer.core.experiment, gossamer.compression; "
        "gossamer.compression.CODECS; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- malformed payloads ---------------------------------------------------------------------


def _valid(spec: str, shape: tuple[int, ...]) -> tuple[Codec, Payload]:
    codec = parse_codec(spec, seed=0)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return codec, codec.encode(x)


def _set(p: Payload, name: str, t: Any) -> Payload:
    return Payload({**p.tensors, name: t}, dict(p.meta))


def _drop(p: Payload, name: str) -> Payload:
    return Payload({k: v for k, v in p.tensors.items() if k != name}, dict(p.meta))


def _with_meta(p: Payload, **kw: Any) -> Payload:
    return Payload(dict(p.tensors), {**p.meta, **kw})


def _edit(t: torch.Tensor, i: int, v: float | int) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[i] = v
    return t


MALFORMED = {
    "topk index out of range": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "indices", _edit(p.tensors["indices"], -1, 50)),
    ),
    "topk negative index": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "indices", _edit(p.tensors["indices"], 0, -1)),
    ),
    "topk duplicate index": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "indices", _edit(p.tensors["indices"], 1, int(p.tensors["indices"][0]))),
    ),
    "topk unsorted indices": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "indices", p.tensors["indices"].flip(0).contiguous()),
    ),
    "topk wrong count": (
        "topk:0.1",
        (50,),
        lambda p: Payload(
            {"indices": p.tensors["indices"][:-1], "values": p.tensors["values"][:-1]}
        ),
    ),
    "topk truncated values": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "values", p.tensors["values"][:-1]),
    ),
    "topk int64 indices": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "indices", p.tensors["indices"].long()),
    ),
    "topk float indices": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "indices", p.tensors["indices"].float()),
    ),
    "topk nan value": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "values", _edit(p.tensors["values"], 0, math.nan)),
    ),
    "topk missing values": ("topk:0.1", (50,), lambda p: _drop(p, "values")),
    "topk extra tensor": ("topk:0.1", (50,), lambda p: _set(p, "extra", torch.zeros(1))),
    "topk extra meta": ("topk:0.1", (50,), lambda p: _with_meta(p, ratio=0.1)),
    "topk 2-d values": (
        "topk:0.1",
        (50,),
        lambda p: _set(p, "values", p.tensors["values"].reshape(1, -1)),
    ),
    "int8 scales count": ("int8", (600,), lambda p: _set(p, "absmax", p.tensors["absmax"][:-1])),
    "int8 negative scale": (
        "int8",
        (600,),
        lambda p: _set(p, "absmax", _edit(p.tensors["absmax"], 0, -1.0)),
    ),
    "int8 infinite scale": (
        "int8",
        (600,),
        lambda p: _set(p, "absmax", _edit(p.tensors["absmax"], 0, math.inf)),
    ),
    "int8 q is -128": ("int8", (600,), lambda p: _set(p, "q", _edit(p.tensors["q"], 3, -128))),
    "int8 q truncated": ("int8", (600,), lambda p: _set(p, "q", p.tensors["q"][:-1])),
    "int8 q as uint8": ("int8", (600,), lambda p: _set(p, "q", p.tensors["q"].view(torch.uint8))),
    "int8 block meta": ("int8", (600,), lambda p: _with_meta(p, block=128)),
    "int8 block meta str": ("int8", (600,), lambda p: _with_meta(p, block="256")),
    "int8 block meta bool": ("int8", (600,), lambda p: _with_meta(p, block=True)),
    "int8 block meta list": ("int8", (600,), lambda p: _with_meta(p, block=[256])),
    "int8 block meta missing": ("int8", (600,), lambda p: Payload(dict(p.tensors), {})),
    "qsgd level above L": (
        "qsgd:4",
        (30,),
        lambda p: _set(p, "levels", _edit(p.tensors["levels"], 0, 5)),
    ),
    "qsgd level -128": (
        "qsgd:4",
        (30,),
        lambda p: _set(p, "levels", _edit(p.tensors["levels"], 0, -128)),
    ),
    "qsgd negative norm": ("qsgd:4", (30,), lambda p: _set(p, "norm", -p.tensors["norm"])),
    "qsgd nan norm": ("qsgd:4", (30,), lambda p: _set(p, "norm", torch.tensor([math.nan]))),
    "qsgd norm of two": ("qsgd:4", (30,), lambda p: _set(p, "norm", p.tensors["norm"].repeat(2))),
    "qsgd one norm for two buckets": ("qsgd:4", (600,), lambda p: _set(p, "norm", p.tensors["norm"][:1])),
    "qsgd norm per bucket as 2-d": ("qsgd:4", (600,), lambda p: _set(p, "norm", p.tensors["norm"].view(1, 2))),
    "qsgd negative last norm": ("qsgd:4", (600,), lambda p: _set(p, "norm", _edit(p.tensors["norm"], 1, -1.0))),
    "qsgd infinite norm": ("qsgd:4", (600,), lambda p: _set(p, "norm", _edit(p.tensors["norm"], 0, math.inf))),
    "qsgd norm as fp16": ("qsgd:4", (600,), lambda p: _set(p, "norm", p.tensors["norm"].half())),
    "qsgd level -5 in the tail": ("qsgd:4", (600,), lambda p: _set(p, "levels", _edit(p.tensors["levels"], -1, -5))),
    "qsgd levels truncated": ("qsgd:4", (600,), lambda p: _set(p, "levels", p.tensors["levels"][:-1])),
    "qsgd bucket meta": ("qsgd:4", (600,), lambda p: _with_meta(p, bucket=256)),
    "qsgd bucket meta bool": ("qsgd:4", (600,), lambda p: _with_meta(p, bucket=True)),
    "qsgd bucket meta missing": ("qsgd:4", (600,), lambda p: Payload(dict(p.tensors), {"levels": 4})),
    "qsgd levels meta": ("qsgd:4", (30,), lambda p: _with_meta(p, levels=3)),
    "qsgd levels meta float": ("qsgd:4", (30,), lambda p: _with_meta(p, levels=4.0)),
    "qsgd levels meta none": ("qsgd:4", (30,), lambda p: _with_meta(p, levels=None)),
    "powersgd p wrong rows": ("powersgd:2", (30, 20), lambda p: _set(p, "p", p.tensors["p"][:-1])),
    "powersgd q wrong rank": ("powersgd:2", (30, 20), lambda p: _set(p, "q", torch.zeros(20, 3))),
    "powersgd both wrong rank": (
        "powersgd:2",
        (30, 20),
        lambda p: Payload({"p": torch.zeros(30, 3), "q": torch.zeros(20, 3)}, {"rank": 3}),
    ),
    "powersgd rank meta": ("powersgd:2", (30, 20), lambda p: _with_meta(p, rank=1)),
    "powersgd raw instead": (
        "powersgd:2",
        (30, 20),
        lambda p: Payload({"values": torch.zeros(600)}, {"rank": 0}),
    ),
    "powersgd overflowing factors": (
        "powersgd:2",
        (30, 20),
        lambda p: Payload(
            {"p": torch.full((30, 2), 1e30), "q": torch.full((20, 2), 1e30)}, {"rank": 2}
        ),
    ),
    "powersgd q int16": ("powersgd:2", (30, 20), lambda p: _set(p, "q", p.tensors["q"].to(torch.int16))),
    "powersgd p float32": ("powersgd:2", (30, 20), lambda p: _set(p, "p", p.tensors["p"].float())),
    "sign padding bits set": (
        "sign",
        (13,),
        lambda p: _set(p, "bits", _edit(p.tensors["bits"], -1, 255)),
    ),
    "sign bits short": ("sign", (13,), lambda p: _set(p, "bits", p.tensors["bits"][:1])),
    "sign negative scale": ("sign", (13,), lambda p: _set(p, "scale", torch.tensor([-1.0]))),
    "sign inf scale": ("sign", (13,), lambda p: _set(p, "scale", torch.tensor([math.inf]))),
    "sign bits as bool": ("sign", (13,), lambda p: _set(p, "bits", p.tensors["bits"].bool())),
    "randk negative seed": ("randk:0.1", (50,), lambda p: _with_meta(p, seed=-1)),
    "randk seed beyond 32 bits": ("randk:0.1", (50,), lambda p: _with_meta(p, seed=2**32)),
    "randk float seed": ("randk:0.1", (50,), lambda p: _with_meta(p, seed=1.0)),
    "randk bool seed": ("randk:0.1", (50,), lambda p: _with_meta(p, seed=True)),
    "randk missing seed": ("randk:0.1", (50,), lambda p: Payload(dict(p.tensors), {})),
    "randk indices sent": ("randk:0.1", (50,), lambda p: _set(p, "indices", torch.arange(5))),
    "randk wrong count": ("randk:0.1", (50,), lambda p: _set(p, "values", p.tensors["values"][:-1])),
    "randk nan value": (
        "randk:0.1",
        (50,),
        lambda p: _set(p, "values", _edit(p.tensors["values"], 0, math.nan)),
    ),
    "randk int values": (
        "randk:0.1",
        (50,),
        lambda p: _set(p, "values", p.tensors["values"].to(torch.int16)),
    ),
    "fp16 sent as fp32": ("fp16", (10,), lambda p: _set(p, "values", p.tensors["values"].float())),
    "none inf value": (
        "none",
        (10,),
        lambda p: _set(p, "values", _edit(p.tensors["values"], 2, math.inf)),
    ),
    "none float64": ("none", (10,), lambda p: _set(p, "values", p.tensors["values"].double())),
    "none too long": ("none", (10,), lambda p: _set(p, "values", torch.zeros(11))),
    "none not a tensor": ("none", (10,), lambda p: _set(p, "values", [0.0] * 10)),
    "none unexpected meta": ("none", (10,), lambda p: _with_meta(p, x=1)),
    "tensors not a map": ("none", (10,), lambda p: Payload([("values", p.tensors["values"])], {})),  # type: ignore[arg-type]
    "meta not a map": ("none", (10,), lambda p: Payload(dict(p.tensors), [])),  # type: ignore[arg-type]
    "not a payload": ("none", (10,), lambda p: {"values": p.tensors["values"]}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_payload_is_rejected_with_protocol_error(case):
    spec, shape, mutate = MALFORMED[case]
    codec, p = _valid(spec, shape)
    codec.decode(p, shape, torch.float32)  # the unmutated payload is fine
    with pytest.raises(ProtocolError):
        codec.decode(mutate(p), shape, torch.float32)


_wire_dtypes = sorted(WIRE_DTYPES, key=str)
_junk_meta = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(),
    st.text(max_size=3),
    st.lists(st.integers(0, 300), max_size=3),
)


@st.composite
def mutations(draw: st.DrawFn, p: Payload) -> Payload:
    tensors, meta = dict(p.tensors), dict(p.meta)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                [
                    "drop",
                    "add",
                    "dtype",
                    "resize",
                    "poke",
                    "reshape",
                    "meta",
                    "meta_drop",
                    "meta_add",
                ]
            )
        )
        names = sorted(tensors)
        if kind == "add" or not names:
            tensors[draw(st.sampled_from(["values", "p", "q", "bits", "x"]))] = torch.zeros(
                draw(st.integers(0, 5))
            )
            continue
        name = draw(st.sampled_from(names))
        t = tensors[name]
        if kind == "drop":
            del tensors[name]
        elif kind == "dtype":
            tensors[name] = t.to(draw(st.sampled_from(_wire_dtypes)))
        elif kind == "resize":
            n = draw(st.integers(0, t.numel() + 3))
            tensors[name] = torch.cat([t.reshape(-1), torch.zeros(3, dtype=t.dtype)])[:n]
        elif kind == "reshape" and t.numel():
            tensors[name] = t.reshape(1, -1)
        elif kind == "poke" and t.numel():
            t = t.clone()
            i = draw(st.integers(0, t.numel() - 1))
            if t.is_floating_point():
                t.view(-1)[i] = draw(
                    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e38, 0.0, 5.0])
                )
            elif t.dtype == torch.bool:
                t.view(-1)[i] = not bool(t.view(-1)[i])
            else:
                info = torch.iinfo(t.dtype)
                t.view(-1)[i] = draw(
                    st.sampled_from(
                        [info.min, info.max, -1, 0, 1, 50, 255 if info.max >= 255 else 7]
                    )
                )
            tensors[name] = t
        elif kind == "meta" and meta:
            meta[draw(st.sampled_from(sorted(meta)))] = draw(_junk_meta)
        elif kind == "meta_drop" and meta:
            del meta[draw(st.sampled_from(sorted(meta)))]
        elif kind == "meta_add":
            meta[draw(st.sampled_from(["rank", "block", "levels", "seed", "extra"]))] = draw(
                _junk_meta
            )
    return Payload(tensors, meta)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    spec=st.sampled_from(SPECS),
    shape=st.sampled_from([(50,), (30, 20), (1,), (0,), (9,), (2, 3)]),
)
def test_fuzzed_payloads_decode_to_the_right_shape_or_raise_only_protocol_error(data, spec, shape):
    codec, p = _valid(spec, shape)
    bad = data.draw(mutations(p))
    try:
        y = codec.decode(bad, shape, torch.float32)
    except ProtocolError:
        return
    assert y.shape == shape and y.dtype == torch.float32 and bool(torch.isfinite(y).all())


# --- chunk compressor -----------------------------------------------------------------------

PARAMS = [
    ("enc.weight", 24 * 16),
    ("enc.bias", 16),
    ("empty", 0),
    ("dec.weight", 16 * 10),
    ("dec.bias", 10),
]
SHAPES = {"enc.weight": (24, 16), "enc.bias": (16,), "dec.weight": (16, 10), "dec.bias": (10,)}


def plan(chunk_numel: int = 200) -> ShardPlan:
    return ShardPlan.build(
        PARAMS, num_shards=1 if chunk_numel >= 10_000 else 2, chunk_numel=chunk_numel
    )


def test_segments_tile_each_chunk_and_keep_real_shapes_only_for_whole_parameters():
    pl = plan(200)
    cc = ChunkCompressor("powersgd:2", pl, shapes=SHAPES)
    starts = dict.fromkeys(n for n, _ in PARAMS)
    offset = 0
    for name, numel in PARAMS:
        starts[name] = offset
        offset += numel
    for c in pl.chunks:
        segs = cc.segments(c.index)
        assert sum(s.numel for s in segs) == c.numel
        at = 0
        for s in segs:
            assert s.chunk_offset == at and starts[s.param] + s.param_offset == c.flat_offset + at
            whole = s.numel == dict(PARAMS)[s.param]
            assert s.shape == (SHAPES[s.param] if whole else (s.numel,))
            at += s.numel
    whole = ChunkCompressor("powersgd:2", plan(10_000), shapes=SHAPES).segments(0)
    assert [s.shape for s in whole] == [(24, 16), (16,), (16, 10), (10,)]
    # Shape-agnostic codecs merge a chunk's parameters into one segment (one payload).
    merged = ChunkCompressor("topk:0.1", plan(10_000), shapes=SHAPES).segments(0)
    assert [(s.numel, s.shape) for s in merged] == [(pl.total_numel, (pl.total_numel,))]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("chunk_numel", [100, 10_000])
def test_a_separate_decoder_rebuilds_each_chunk_within_the_codecs_bounds(spec, chunk_numel):
    pl = plan(chunk_numel)
    enc = ChunkCompressor(spec, pl, shapes=SHAPES, error_feedback=False, seed=1)
    dec = ChunkCompressor(spec, pl, shapes=SHAPES)
    flat = torch.randn(pl.total_numel, generator=torch.Generator().manual_seed(3))
    for c in pl.chunks:
        values = flat[c.flat_offset : c.flat_offset + c.numel]
        tensors, meta = enc.encode(c.index, values)
        assert all(name.startswith(f"c{c.index}/") for name in tensors)
        out = dec.decode(c.index, tensors, meta)
        assert out.shape == (c.numel,) and out.dtype == torch.float32
        for seg in dec.segments(c.index):
            x = values[seg.chunk_offset : seg.chunk_offset + seg.numel].reshape(seg.shape)
            y = out[seg.chunk_offset : seg.chunk_offset + seg.numel].reshape(seg.shape)
            ok, worst = within_bound(parse_codec(spec), x, y)
            assert ok, f"{seg}: off by {worst}"
    assert enc.raw_bytes == dec.raw_bytes == 4 * pl.total_numel
    assert enc.wire_bytes == dec.wire_bytes > 0
    assert enc.encode_seconds > 0 and dec.decode_seconds > 0


def test_chunk_payload_travels_through_the_frame_format_in_the_message_meta():
    pl = plan(10_000)
    enc = ChunkCompressor("topk:0.1", pl, shapes=SHAPES, overrides=[("*.bias", "none")])
    dec = ChunkCompressor("topk:0.1", pl, shapes=SHAPES, overrides=[("*.bias", "none")])
    values = torch.randn(pl.total_numel)
    tensors, meta = enc.encode(0, values)
    msg = decode_frames(
        encode_frames(Message(op="PUSH", tensors=tensors, meta={"compression": {"0": meta}}))
    )
    out = dec.decode(0, msg.tensors, msg.meta["compression"]["0"])
    assert torch.equal(out, dec.decode(0, tensors, meta))
    assert enc.wire_bytes < enc.raw_bytes / 3


def test_overrides_pick_the_first_matching_pattern_and_default_otherwise():
    cc = ChunkCompressor(
        "topk:0.01", plan(), overrides=[("*.bias", "none"), ("enc.*", "int8"), ("enc.bias", "sign")]
    )
    assert cc.codecs() == {
        "enc.weight": "int8",
        "enc.bias": "none",
        "empty": "topk:0.01",
        "dec.weight": "topk:0.01",
        "dec.bias": "none",
    }
    assert cc.codec_of("other") == "topk:0.01"


def test_error_feedback_defaults_to_on_for_biased_codecs_only():
    cc = ChunkCompressor(
        "topk:0.1", plan(10_000), overrides=[("*.bias", "qsgd:8"), ("dec.*", "none")]
    )
    assert cc.uses_error_feedback("enc.weight")
    assert not cc.uses_error_feedback("enc.bias") and not cc.uses_error_feedback("dec.weight")
    assert ChunkCompressor("none", plan(), error_feedback=True).uses_error_feedback("enc.weight")
    assert not ChunkCompressor("sign", plan(), error_feedback=False).uses_error_feedback(
        "enc.weight"
    )


def test_chunk_error_feedback_accumulates_what_topk_dropped():
    pl = plan(10_000)
    enc, dec = ChunkCompressor("topk:0.05", pl), ChunkCompressor("topk:0.05", pl)
    g = torch.Generator().manual_seed(0)
    sent = torch.zeros(pl.total_numel, dtype=torch.float64)
    total = torch.zeros(pl.total_numel, dtype=torch.float64)
    for _ in range(5):
        grad = torch.randn(pl.total_numel, generator=g)
        sent += dec.decode(0, *enc.encode(0, grad)).double()
        total += grad.double()
    residual = enc.feedback.residual("c0").reshape(-1)  # error feedback is kept per chunk
    assert torch.allclose(sent + residual.double(), total, atol=1e-4)


def test_chunk_error_feedback_compensates_in_the_residual_buffer_and_keeps_it_exact():
    """At a size the pools serve: one residual buffer per chunk across steps (no new sum and
    residual per step), the same invariant, and a non-finite gradient refused before the
    residual is touched."""
    big = ShardPlan.build([("w", 1 << 17)], num_shards=1, chunk_numel=1 << 17)
    enc, dec = ChunkCompressor("topk:0.01", big), ChunkCompressor("topk:0.01", big)
    g = torch.Generator().manual_seed(0)
    sent = torch.zeros(big.total_numel, dtype=torch.float64)
    total = torch.zeros(big.total_numel, dtype=torch.float64)
    buffers = set()
    for _ in range(6):
        grad = torch.randn(big.total_numel, generator=g)
        sent += dec.decode(0, *enc.encode(0, grad)).double()
        total += grad.double()
        buffers.add(enc.feedback.residual("c0").untyped_storage().data_ptr())
    assert len(buffers) == 1  # the first step's residual, reused in place ever since
    residual = enc.feedback.residual("c0")
    assert torch.allclose(sent + residual.double(), total, atol=1e-4)
    before = residual.clone()
    with pytest.raises(ValueError, match="NaN or Inf"):
        enc.encode(0, torch.full((big.total_numel,), float("nan")))
    assert torch.equal(enc.feedback.residual("c0"), before)


def test_decoder_refuses_a_sender_using_another_codec():
    pl = plan(10_000)
    tensors, meta = ChunkCompressor("int8", pl).encode(0, torch.randn(pl.total_numel))
    with pytest.raises(ProtocolError, match="int8"):
        ChunkCompressor("topk:0.1", pl).decode(0, tensors, meta)


@pytest.mark.parametrize("spec", ["int8", "powersgd:2"])
def test_chunk_decode_rejects_meta_and_tensors_that_do_not_fit_the_plan(spec):
    pl = plan(10_000)
    cc = ChunkCompressor(spec, pl, shapes=SHAPES)
    tensors, meta = cc.encode(0, torch.randn(pl.total_numel))
    segs = meta["segments"]
    bad_metas = [
        None,
        [],
        {**meta, "v": 2},
        {**meta, "chunk": 1},
        {**meta, "numel": 1},
        {**meta, "numel": True},
        {**meta, "segments": segs[:-1]},
        {**meta, "segments": {}},
        {**meta, "extra": 1},
        {**meta, "segments": [{**segs[0], "offset": 1}, *segs[1:]]},
        {**meta, "segments": [{**segs[0], "param": "dec.bias"}, *segs[1:]]},
        {**meta, "segments": [{**segs[0], "numel": "384"}, *segs[1:]]},
        {**meta, "segments": [{**segs[0], "meta": []}, *segs[1:]]},
        {**meta, "segments": [{k: v for k, v in segs[0].items() if k != "codec"}, *segs[1:]]},
        {**meta, "segments": [*segs[:-1], 5]},
    ]
    for bad in bad_metas:
        with pytest.raises(ProtocolError):
            cc.decode(0, tensors, bad)
    for name in list(tensors):
        with pytest.raises(ProtocolError):
            cc.decode(0, {k: v for k, v in tensors.items() if k != name}, meta)
    for extra in ["c0/9/values", "c0/x/values", "c0/0", "c0/0/extra"]:
        with pytest.raises(ProtocolError):
            cc.decode(0, {**tensors, extra: torch.zeros(1)}, meta)
    with pytest.raises(ProtocolError):
        cc.decode(len(pl.chunks), tensors, meta)
    assert cc.decode(0, {**tensors, "c1/0/values": torch.zeros(3)}, meta).shape == (pl.total_numel,)


def test_chunk_compressor_validates_its_configuration():
    with pytest.raises(ConfigError) as e:
        ChunkCompressor("zip", plan())
    assert e.value.field == "compression"
    with pytest.raises(ConfigError) as e:
        ChunkCompressor("none", plan(), overrides=[("*", "topk:2")])
    assert e.value.field == "overrides"
    with pytest.raises(ConfigError) as e:
        ChunkCompressor("none", plan(), shapes={"enc.weight": (10, 10)})
    assert e.value.field == "shapes"
    with pytest.raises(ValueError):
        ChunkCompressor("none", plan(10_000)).encode(0, torch.zeros(3))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(every_codec(["int8", "topk:0.1", "powersgd:2", "sign"])),
    where=st.sampled_from(["top", "segment", "payload"]),
    key=st.sampled_from(
        [
            "v",
            "chunk",
            "numel",
            "segments",
            "param",
            "offset",
            "codec",
            "meta",
            "block",
            "rank",
            "seed",
            "x",
        ]
    ),
    junk=_junk_meta,
)
def test_fuzzed_chunk_meta_only_ever_raises_protocol_error(spec, where, key, junk):
    pl = plan(10_000)
    cc = ChunkCompressor(spec, pl, shapes=SHAPES)
    tensors, meta = cc.encode(0, torch.randn(pl.total_numel))
    if where == "top":
        meta[key] = junk
    elif where == "segment":
        meta["segments"][0][key] = junk
    else:
        meta["segments"][0]["meta"][key] = junk
    try:
        out = cc.decode(0, tensors, meta)
    except ProtocolError:
        return
    assert out.shape == (pl.total_numel,) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("spec", ["topk:1", "topk:0.5"])
def test_topk_payload_size_does_not_depend_on_tiny_values(spec):
    """A kept value under fp16's normal range used to switch every value to fp32 (payload
    1.5x the nominal size, ~5% of randn(1000) draws at topk:1); it is now a subnormal."""
    codec = parse_codec(spec)
    x = torch.randn(1000)
    x[0], x[1] = 1e-5, -3e-7
    p = codec.encode(x)
    assert codec.nominal_ratio(1000, (1000,)) == pytest.approx(4 * 1000 / p.nbytes)
    err = (codec.decode(p, (1000,), torch.float32) - x).abs()
    assert bool((err <= codec.error_bound(x)).all())


@pytest.mark.parametrize("pooled", [False, True], ids=["small", "pooled"])
@pytest.mark.parametrize("spec", every_codec(["topk:0.05"], lambda e: e.error_feedback and e.elementwise))
def test_chunk_error_feedback_accumulates_what_every_biased_codec_dropped(spec, pooled):
    # pooled: chunks big enough that what decoding gave back goes into a reused buffer
    pl = ShardPlan.build([("w", 1 << 17)], num_shards=1, chunk_numel=1 << 17) if pooled else plan(10_000)
    shapes = {"w": (256, 512)} if pooled else None
    enc, dec = ChunkCompressor(spec, pl, seed=4, shapes=shapes), ChunkCompressor(spec, pl, shapes=shapes)
    g = torch.Generator().manual_seed(1)
    sent = torch.zeros(pl.total_numel, dtype=torch.float64)
    total = torch.zeros(pl.total_numel, dtype=torch.float64)
    for _ in range(5):
        grad = torch.randn(pl.total_numel, generator=g)
        sent += dec.decode(0, *enc.encode(0, grad)).double()
        total += grad.double()
    residual = enc.feedback.residual("c0").reshape(-1)
    assert torch.allclose(sent + residual.double(), total, atol=1e-4)


# --- randk ----------------------------------------------------------------------------------


def test_randk_positions_are_a_golden_function_of_seed_size_and_count():
    """The receiver rebuilds the sender's positions: any change to `positions` is a wire change."""
    assert positions(12345, 20, 5).tolist() == [2, 15, 17, 18, 19]
    assert positions(12346, 20, 5).tolist() == [1, 7, 8, 11, 15]
    assert positions(0, 1000, 6).tolist() == [369, 585, 638, 787, 934, 976]
    assert positions(2**32 - 1, 3, 2).tolist() == [1, 2]
    assert positions(7, 5, 5).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("numel", "k"), [(1, 1), (2, 1), (7, 3), (1024, 10), (1025, 512), (5_000, 4_999)])
def test_randk_positions_are_k_distinct_sorted_indices_in_range(numel, k):
    for seed in (0, 1, 2**31, 2**32 - 1):
        p = positions(seed, numel, k)
        assert p.dtype == torch.int64 and p.numel() == k
        assert int(p.min()) >= 0 and int(p.max()) < numel
        assert k == 1 or bool((p[1:] > p[:-1]).all())


def test_randk_positions_cover_every_index_about_equally_over_seeds():
    numel, k, seeds = 20, 4, 800
    counts = torch.zeros(numel)
    for s in range(seeds):
        counts[positions(zlib.crc32(str(s).encode()), numel, k)] += 1
    expected = seeds * k / numel  # 160, binomial sd ~11: the bounds are 4 sd away
    assert float(counts.min()) > 0.7 * expected and float(counts.max()) < 1.3 * expected


def test_randk_refuses_tensors_beyond_32_bit_positions():
    with pytest.raises(ValueError):
        positions(0, 2**32 + 1, 3)


def test_randk_payload_holds_only_values_and_a_seed_and_another_instance_decodes_it():
    x = torch.randn(10_000)
    enc = parse_codec("randk:0.01", seed=5)
    p = enc.encode(x, key="w")
    assert set(p.tensors) == {"values"} and p.tensors["values"].dtype == torch.float16
    assert p.tensors["values"].numel() == 100 and p.nbytes == 200
    assert set(p.meta) == {"seed"} and 0 <= p.meta["seed"] < 2**32
    y = parse_codec("randk:0.01").decode(p, (10_000,), torch.float32)  # no seed of its own
    kept = positions(p.meta["seed"], 10_000, 100)
    assert torch.equal(y.nonzero().reshape(-1), kept)
    assert torch.equal(y[kept], x[kept].half().float())


def test_randk_draws_new_positions_per_step_and_per_tensor_reproducibly():
    x = torch.randn(1000)
    a = parse_codec("randk:0.05", seed=1)
    seeds = [a.encode(x, key="w").meta["seed"] for _ in range(3)] + [a.encode(x, key="b").meta["seed"]]
    assert len(set(seeds)) == 4
    again = parse_codec("randk:0.05", seed=1)
    assert [again.encode(x, key="w").meta["seed"] for _ in range(3)] == seeds[:3]
    assert parse_codec("randk:0.05", seed=2).encode(x, key="w").meta["seed"] != seeds[0]


def test_error_feedback_lets_randk_eventually_send_every_coordinate():
    codec, ef = parse_codec("randk:0.1"), ErrorFeedback()
    grad = torch.linspace(1, 2, 50)
    touched = torch.zeros(50, dtype=torch.bool)
    for _ in range(60):
        comp = ef.compensate("k", grad)
        decoded = codec.decode(codec.encode(comp, key="k"), (50,), torch.float32)
        ef.update("k", comp, decoded)
        touched |= decoded != 0
    assert bool(touched.all())
