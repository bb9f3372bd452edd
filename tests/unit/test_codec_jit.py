"""The codecs' numba kernels against their torch paths: the same payload bytes, the same decoded bits, the same errors."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from gossamer.compression import _jit
from gossamer.compression.codec import Codec, Payload
from gossamer.compression.codec_spec import parse_codec
from gossamer.compression.quantization import INT8_BLOCK
from gossamer.core.errors import ProtocolError

SPECS = ("fp16", "bf16", "int8", "sign", "topk:0.01", "topk:0.2")
# Around every boundary the kernels have: a byte of signs (8), an int8 block (512), a group
# of int8 blocks (16 x 512) and of sign rows (4096), and sizes off all of them.
SIZES = (0, 1, 7, 8, 9, 63, 64, 65, 511, 512, 513, 4095, 4096, 4097, 16 * 512 - 1, 16 * 512 + 5, 70001)
BIG = (1 << 20) + 4101  # the default threshold passed: kernels on, numba imported there


@pytest.fixture
def jit_everywhere(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Kernels for tensors of any size (the default spares small ones numba's import)."""
    monkeypatch.setattr(_jit, "MIN_NUMEL", 0)
    yield


def _both(fn):  # type: ignore[no-untyped-def]
    """fn() with the kernels on, then off; (result or exception) of each."""
    results = []
    for flag in (True, False):
        old = _jit.set_enabled(flag)
        try:
            results.append(fn())
        except (ValueError, ProtocolError) as exc:
            results.append(exc)
        finally:
            _jit.set_enabled(old)
    return results


def _same_payload(spec: str, a: Payload, b: Payload) -> None:
    assert a.meta == b.meta
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        ta, tb = a.tensors[name], b.tensors[name]
        assert ta.dtype == tb.dtype and ta.shape == tb.shape, (spec, name)
        if spec == "sign" and name == "scale":
            continue  # its own test: fp32 row sums in another order (see _numba_kernels.sign_encode)
        assert ta.contiguous().view(torch.uint8).tolist() == tb.contiguous().view(torch.uint8).tolist(), (spec, name)


def _int8_ties(n: int) -> torch.Tensor:
    """Blocks whose fp16 scale is 1.0 and values with x / 1.0 * 127 at exactly m + 1/2 in fp32:
    half to even (torch.round) and half away from zero differ on every one."""
    cands = torch.tensor([(m + 0.5) / 127 for m in range(-127, 127)], dtype=torch.float32)
    ties = cands[(cands * 127) == (cands * 127).floor() + 0.5]
    reps = -(-n // ties.numel()) if n else 0
    x = ties.repeat(reps)[:n]
    x[::INT8_BLOCK] = 1 - 2.0**-10  # absmax * (1 + 2**-10) rounds to 1.0 in fp16
    return x


def _inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    halfway = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0**-25, 3 * 2.0**-26])
    mixed = x * 1e-3
    mixed[::5] = 0.0
    mixed[1::7] = -0.0
    if n:
        mixed[: min(n, halfway.numel())] = halfway[: min(n, halfway.numel())]
    denormal = x * 1e-40  # fp32 subnormals; int8 blocks under fp16's normal range
    some_denormal = x.clone()
    some_denormal[::3] *= 1e-40
    return {
        "randn*1e-3": x * 1e-3,
        "randn": x,
        "zeros": torch.zeros(n),
        "negative zeros": torch.full((n,), -0.0),
        "mixed": mixed,
        "denormal": denormal,
        "some denormal": some_denormal,
        "beyond fp16": x * 1e5,  # fp16 clamps, int8 scales travel as fp32
        "near fp32 max": x * 1e37,  # bf16 clamps past its max
        "integers": torch.randint(-300, 300, (n,), generator=g).float(),
        "int8 ties": _int8_ties(n),
    }


@pytest.fixture(params=["one part", "three parts"])
def parts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One kernel call per tensor, or (as with 3 torch threads and large tensors) three
    concurrent calls on consecutive parts where the codec splits its work (`_jit.call_parts`)."""
    threads = torch.get_num_threads()
    if request.param == "three parts":
        monkeypatch.setattr(_jit, "PART_MIN", 64)
        torch.set_num_threads(3)
    else:
        monkeypatch.setattr(_jit, "PART_MIN", 1 << 40)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("jit_everywhere", "parts")
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_payload_and_decode_are_the_torch_paths_bit_for_bit(spec: str, n: int) -> None:
    for kind, x in _inputs(n, seed=n).items():
        codec = parse_codec(spec, seed=0)
        with_jit, without = _both(lambda: codec.encode(x, key="k"))  # noqa: B023
        if isinstance(without, Exception):
            assert type(with_jit) is type(without), (spec, kind)
            continue
        _same_payload(spec, with_jit, without)
        for out in (None, torch.full((n,), 7.0)):
            dec_jit, dec_torch = _both(lambda: codec.decode(without, (n,), torch.float32, out=None if out is None else out.clone()))  # noqa: B023
            assert torch.equal(dec_jit.view(torch.int32), dec_torch.view(torch.int32)), (spec, kind)


@pytest.mark.parametrize("spec", SPECS)
def test_kernels_run_at_the_default_threshold_and_match(spec: str) -> None:
    assert _jit.available(BIG), "numba kernels unavailable: the comparison would be torch against torch"
    x = torch.randn(BIG, generator=torch.Generator().manual_seed(3)) * 1e-3
    codec = parse_codec(spec, seed=0)
    with_jit, without = _both(lambda: codec.encode(x))
    _same_payload(spec, with_jit, without)
    dec_jit, dec_torch = _both(lambda: codec.decode(without, (BIG,), torch.float32, out=torch.empty(BIG)))
    assert torch.equal(dec_jit.view(torch.int32), dec_torch.view(torch.int32))


@pytest.mark.usefixtures("jit_everywhere")
@pytest.mark.parametrize("n", (1, 8, 64, 4096 * 3 + 61, BIG))
def test_sign_scale_is_within_its_documented_rounding_of_the_torch_paths(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    codec = parse_codec("sign")
    with_jit, without = _both(lambda: codec.encode(x))
    s_jit, s_torch = float(with_jit.tensors["scale"]), float(without.tensors["scale"])
    wide = x.double()
    exact = min(math.sqrt(float(wide.pow(2).mean())), 1.5 * float(wide.abs().mean()))
    assert s_jit <= exact and s_torch <= exact  # never more than min(rms, 1.5 mean |x|)
    assert exact - s_jit <= exact * 2.0**-17
    assert abs(s_jit - s_torch) <= exact * 2.0**-17


@pytest.mark.usefixtures("jit_everywhere")
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", (math.nan, math.inf, -math.inf))
@pytest.mark.parametrize("n", (1, 9, 513, 16 * 512 + 5))
def test_nan_and_inf_are_refused_by_both_paths(spec: str, bad: float, n: int) -> None:
    for at in {0, n // 2, n - 1}:
        x = torch.randn(n, generator=torch.Generator().manual_seed(at)) * 1e-3
        x[at] = bad
        codec = parse_codec(spec, seed=0)
        with_jit, without = _both(lambda: codec.encode(x))  # noqa: B023
        assert isinstance(with_jit, ValueError) and isinstance(without, ValueError), (spec, at)


def _decode_both(codec: Codec, p: Payload, n: int) -> list[object]:
    return _both(lambda: codec.decode(p, (n,), torch.float32, out=torch.empty(n)))


@pytest.mark.usefixtures("jit_everywhere")
@pytest.mark.parametrize("n", (INT8_BLOCK, 16 * 512 + 5))
def test_malformed_payloads_are_refused_by_both_paths(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    int8 = parse_codec("int8")
    p = int8.encode(x)
    p.tensors["q"][n - 1] = -128
    assert all(isinstance(r, ProtocolError) for r in _decode_both(int8, p, n))
    for spec, bad in (("fp16", math.inf), ("bf16", math.nan)):
        codec = parse_codec(spec)
        p = codec.encode(x)
        p.tensors["values"][n // 2] = bad
        assert all(isinstance(r, ProtocolError) for r in _decode_both(codec, p, n)), spec
    topk = parse_codec("topk:0.2")
    for corrupt in ("swap", "duplicate", "past the end", "negative"):
        p = topk.encode(x)
        idx = p.tensors["indices"]
        if corrupt == "swap":
            idx[[0, 1]] = idx[[1, 0]]
        elif corrupt == "duplicate":
            idx[1] = idx[0]
        elif corrupt == "past the end":
            idx[-1] = n
        else:
            idx[0] = -1
        assert all(isinstance(r, ProtocolError) for r in _decode_both(topk, p, n)), corrupt


def test_small_tensors_do_not_use_the_kernels() -> None:
    assert not _jit.available(_jit.MIN_NUMEL - 1)


_DECODES_A_LARGE_PUSH = """
import sys, torch
from gossamer.compression import parse_codec
from gossamer.compression.kernels import kernels_unless_asked
on = kernels_unless_asked()  # what a shard role process does at start
codec = parse_codec("int8")
x = torch.randn(1 << 20)
assert torch.allclose(codec.decode(codec.encode(x), (1 << 20,), torch.float32), x, atol=0.05)
print(on, "numba" in sys.modules)
"""


@pytest.mark.parametrize(("env", "want"), [(None, "False False"), ("1", "True True"), ("0", "False False")])
def test_a_shard_process_decodes_without_numba_unless_asked(env: str | None, want: str) -> None:
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != _jit.ENV}
    if env is not None:
        environ[_jit.ENV] = env
    out = subprocess.run([sys.executable, "-c", _DECODES_A_LARGE_PUSH], env=environ, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split("\n")[-2]
    assert out == want, out
