"""Top-k sparsification: send only the largest-magnitude entries (`topk:R`)."""

from __future__ import annotations

import math
import struct
from typing import ClassVar

import torch

from gossamer.compression import _jit
from gossamer.compression._kernels import Scratch, spans
from gossamer.compression.codec import (
    Codec,
    Payload,
    all_finite,
    expect_float,
    fp32_slack,
    into,
    payload_tensor,
)
from gossamer.core.errors import ConfigError, ProtocolError

__all__ = ["SAMPLED_MIN_NUMEL", "TopKCodec", "fits_fp16", "topk_count", "topk_indices", "topk_select"]

#: From this size on, top-k selects through a threshold estimated on a sample (DGC).
SAMPLED_MIN_NUMEL = 1 << 18
_SAMPLE_SHARE = 0.001  # DGC samples 0.1 % to 1 %; 1 % cost 8 ms more per 100M values
_MIN_SAMPLE = 1 << 14
_OVERSHOOT = 1.25  # aim the threshold at 1.25 k candidates, so fewer than k is rare
_GROUP = 8  # 16 cost 5 % more at 1 % density (more of the chunk in the second stage)

_INT16_LIMIT = 2**15 - 1
_INT32_LIMIT = 2**31 - 1
_FP16_MAX = 65504.0
_FP16_SUBNORMAL_ERR = 2.0**-25  # half the spacing of fp16's subnormals


def fits_fp16(values: torch.Tensor) -> bool:
    """No magnitude overflows fp16. Values under its normal range become subnormals (absolute
    error at most 2**-25): refusing them made a payload's size depend on the data (a kept
    value of 1e-5 doubled it) while its nominal ratio promised fp16."""
    return values.numel() == 0 or bool(values.abs().max() <= _FP16_MAX)


def topk_count(ratio: float, numel: int) -> int:
    """How many entries top-k keeps: round(ratio * numel), at least 1 of a non-empty tensor."""
    if numel == 0:
        return 0
    return min(numel, max(1, round(ratio * numel)))


def topk_indices(flat: torch.Tensor, k: int, scratch: Scratch | None = None) -> torch.Tensor:
    """The positions of the k largest |flat|, increasing (int64); ties broken arbitrarily.

    `scratch` is no longer used (the selection writes no chunk-sized temporary).

    Raises:
        ValueError: `flat` holds NaN or Inf.
    """
    return topk_select(flat, k)[0]


def topk_select(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values) of the k largest |flat|: positions increasing (int64), values
    ``flat[positions]``; ties broken arbitrarily.

    Small tensors go through `torch.topk`. Large ones follow Deep Gradient Compression (Lin et
    al. 2018, https://arxiv.org/abs/1712.01887, section 3.4): the threshold is estimated on a
    strided 0.1 % sample (at least 16384 values), aimed a little low, and one pass keeps the
    candidates above it, in order, with their values; the
    exact top-k of those few candidates is then the exact top-k of the tensor, since every
    entry left out lies below every candidate. When the sample misjudged and fewer than k
    passed, the threshold is lowered once and then the exact selection runs on all of it:
    the result never changes, only the cost.

    Raises:
        ValueError: `flat` holds NaN or Inf (found on the way, without a pass of its own).
    """
    n = flat.numel()
    if n < SAMPLED_MIN_NUMEL or k * 8 > n:
        if not all_finite(flat):
            raise ValueError("topk: cannot encode a tensor holding NaN or Inf")
        return _exact(flat, k)
    stride = max(1, int(1 / _SAMPLE_SHARE))
    m = -(-n // stride)
    if m < _MIN_SAMPLE:
        stride = max(1, n // _MIN_SAMPLE)
        m = -(-n // stride)
    sample = flat[::stride].abs().float()
    for overshoot in (_OVERSHOOT, 4 * _OVERSHOOT):
        rank = min(m, max(1, math.ceil(k * m / n * overshoot)))
        ranked = torch.topk(sample, rank, sorted=True).values
        threshold = float(ranked[-1])
        # Aimed as far above k as the threshold is below: what passes it is almost surely
        # among the top k, so the exact selection only ranks the band in between.
        sure = float(ranked[max(0, math.floor(k * m / n * (2 - overshoot)) - 1)])
        cands, values = _above(flat, threshold, expect=math.ceil(rank * n / m))
        if cands.numel() >= k:
            keep = _largest(values.abs(), k, sure)
            return torch.masked_select(cands, keep), torch.masked_select(values, keep)
    return _exact(flat, k)


def _exact(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.sort(torch.topk(flat.abs().float(), k, sorted=False).indices).values
    return idx, flat[idx]


def _largest(mags: torch.Tensor, k: int, sure: float = math.inf) -> torch.Tensor:
    """A mask of exactly k entries of `mags`, none smaller than any entry left out.

    A mask keeps the candidates in their (increasing) order: `torch.topk`'s indices needed
    a sort of all k afterwards, which cost twice the selection. Ties at the k-th value are
    taken first come first served. `sure`: a guess that fewer than k entries reach it; when
    right, the k-th value is searched only among the entries below it (`kthvalue` over all
    1.25 k candidates cost a third of top-k's encode).
    """
    m = mags.numel()
    if k >= m:
        return torch.ones(m, dtype=torch.bool)
    above = int((mags >= sure).sum()) if math.isfinite(sure) else 0
    if 0 < above < k:
        band = torch.masked_select(mags, mags < sure)
        kth = torch.kthvalue(band, band.numel() - (k - above) + 1).values
    else:
        kth = torch.kthvalue(mags, m - k + 1).values
    keep = mags > kth
    short = k - int(keep.sum())
    if short:
        keep[(mags == kth).nonzero().view(-1)[:short]] = True
    return keep


def _above(flat: torch.Tensor, threshold: float, expect: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int64, increasing) and values of the entries with |x| >= threshold.

    Through the numba kernel when there is one (`expect`: about how many will pass).

    Comparing into bool and `nonzero` cost 10x an fp32 `abs` per value here, so they only
    run on the groups whose largest magnitude reaches the threshold (about a tenth of them
    when 1 % of the values do). A chunk is viewed as 8 rows; group j is column j, whose max
    over the rows is one vectorised pass (a max over rows of 16 adjacent values took 17x
    longer). The hits come out row by row, each row's in column order: increasing.
    NaN/Inf shows in the column maxima (a max propagates NaN), so it costs no pass of its own.
    """
    if flat.dtype == torch.float32 and _jit.available(flat.numel()):
        fast = _above_jit(flat, threshold, expect)
        if fast is not None:
            return fast
    found: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    for lo, hi in spans(flat.numel()):
        part = flat[lo:hi]
        whole = (hi - lo) // _GROUP * _GROUP
        cols = whole // _GROUP
        rows = part[:whole].view(_GROUP, cols)
        # max |x| of a column as max(max x, -min x): two reads of the chunk, no |x| written.
        peak = torch.maximum(rows.amax(dim=0), rows.amin(dim=0).neg_())
        tail = part[whole:].abs()
        if (cols and not math.isfinite(float(peak.max()))) or not bool(torch.isfinite(tail).all()):
            raise ValueError("topk: cannot encode a tensor holding NaN or Inf")
        hot = (peak >= threshold).nonzero().view(-1)
        nhot = hot.numel()
        if nhot:
            # 1-D nonzero and index_select: 2-D nonzero and advanced indexing cost 2x.
            at = (rows.index_select(1, hot).abs_() >= threshold).view(-1).nonzero().view(-1)
            r = at.div(nhot, rounding_mode="floor")
            pos = hot.index_select(0, at - r * nhot).add_(r * cols)
            found.append(pos.add(lo))
            kept.append(part.index_select(0, pos))
        if tail.numel():
            hits = (tail >= threshold).nonzero().view(-1)
            found.append(hits.add(lo + whole))
            kept.append(part[whole:].index_select(0, hits))
    if not found:
        return torch.zeros(0, dtype=torch.int64), flat[:0]
    return torch.cat(found), torch.cat(kept)


def _above_jit(flat: torch.Tensor, threshold: float, expect: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_above` in one pass of the numba kernel; None when it cannot run."""
    # |x| >= threshold compared as the bits of nonnegative fp32 values (threshold is one)
    bits = struct.unpack("<I", struct.pack("<f", threshold))[0]
    cap = expect + expect // 2 + 1024
    for _ in range(2):  # a second pass only when more passed than there was room for
        pos = torch.empty(cap, dtype=torch.int64)
        values = torch.empty(cap, dtype=torch.float32)
        count = _jit.call("above", flat, bits, pos, values)
        if count is None:
            return None
        if count < 0:
            raise ValueError("topk: cannot encode a tensor holding NaN or Inf")
        if count <= cap:
            return pos[:count], values[:count]
        cap = count
    return None


class TopKCodec(Codec):
    """Keep the `ratio` fraction of entries largest in magnitude (Lin et al., DGC, 2018).

    https://arxiv.org/abs/1712.01887 -- Deep Gradient Compression sends the top 0.1 % of
    the accumulated gradient; the rest stays in the error-feedback residual. No dense zeros
    travel: the payload is ``indices`` (k,) into the flattened tensor, strictly increasing,
    int16 for tensors of up to 32767 elements, int32 up to 2**31 - 1, int64 beyond; and
    ``values`` (k,) in fp16 when every kept value is within fp16's normal range, else fp32, with
    ``k = topk_count(ratio, numel)``; no meta. 4 to 6 bytes per kept entry for most
    tensors, so ``topk:0.01`` is about 67x smaller. Large tensors are selected through a
    sampled threshold (`topk_indices`), which keeps exactly the same k entries.

    Error bound: a kept entry is off by at most its fp16 rounding (2**-11 relative, or
    exact when fp32 values were sent); a dropped entry's error is its own magnitude, and
    any entry larger in magnitude than the k-th largest is always kept. Error feedback
    carries both errors to the next step.
    Biased: use it with error feedback (the default).
    """

    name: ClassVar[str] = "topk"
    checks_finite: ClassVar[bool] = True  # `topk_indices` finds NaN/Inf on its way
    decodes_finite: ClassVar[bool] = True  # validated finite values and zeros

    def __init__(self, ratio: float) -> None:
        if (
            not isinstance(ratio, (int, float))
            or isinstance(ratio, bool)
            or not 0 < ratio <= 1
            or not math.isfinite(ratio)
        ):
            raise ConfigError("codec", f"topk ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    @classmethod
    def from_arg(cls, arg: int | float | None, *, seed: int | None = None) -> TopKCodec:
        return cls(expect_float(arg))

    @property
    def spec(self) -> str:
        return f"topk:{self.ratio!r}"

    @staticmethod
    def _index_dtype(n: int) -> torch.dtype:
        if n <= _INT16_LIMIT:
            return torch.int16
        return torch.int32 if n <= _INT32_LIMIT else torch.int64

    def _encode(self, x: torch.Tensor, shape: tuple[int, ...], key: str | None) -> Payload:
        flat = x.reshape(-1)
        n = flat.numel()
        k = topk_count(self.ratio, n)
        idx, values = topk_select(flat, k)
        values = values.float()
        if k and fits_fp16(values):
            values = values.half()
        return Payload({"indices": idx.to(self._index_dtype(n)), "values": values})

    def _decode(self, p: Payload, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        n = math.prod(shape)
        k = topk_count(self.ratio, n)
        idx = payload_tensor(p, "indices", self._index_dtype(n), (k,))
        raw = p.tensors.get("values")
        vdtype = (
            torch.float16
            if isinstance(raw, torch.Tensor) and raw.dtype == torch.float16
            else torch.float32
        )
        values = payload_tensor(p, "values", vdtype, (k,)).float()
        out = into(out, n)
        if _jit.available(n) and _jit.call("scatter", idx, values, out):
            return out
        out.zero_()
        if k == 0:
            return out
        if int(idx[0]) < 0 or int(idx[-1]) >= n:
            raise ProtocolError(f"topk: index out of range [0, {n})")
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ProtocolError("topk: indices are not strictly increasing (duplicate or unsorted)")
        out[idx.long()] = values
        return out

    def _layout(self, shape: tuple[int, ...]) -> tuple[set[str], set[str]]:
        return {"indices", "values"}, set()

    def _payload_bytes(self, shape: tuple[int, ...]) -> int:
        n = math.prod(shape)
        return topk_count(self.ratio, n) * (2 + self._index_dtype(n).itemsize)

    def error_bound(self, t: torch.Tensor) -> torch.Tensor:
        a = t.detach().double().abs()
        n = a.numel()
        k = topk_count(self.ratio, n)
        if k == 0:
            return a
        kth = torch.topk(a.reshape(-1), k).values.min()
        kept = torch.topk(a.reshape(-1), k).values
        kept_error = torch.clamp(a * 2.0**-11, min=_FP16_SUBNORMAL_ERR) if fits_fp16(kept) else torch.zeros_like(a)
        return torch.where(a > kth, kept_error, a) + fp32_slack(t)
