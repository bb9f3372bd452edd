"""Top-k sparsification: send only the largest-magnitude entries (`topk:R`)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

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
from gossamer.errors import ConfigError, ProtocolError

__all__ = ["SAMPLED_MIN_NUMEL", "TopKCodec", "fits_fp16", "topk_count", "topk_indices"]

#: From this size on, top-k selects through a threshold estimated on a sample (DGC).
SAMPLED_MIN_NUMEL = 1 << 18
_SAMPLE_SHARE = 0.01  # DGC samples 0.1 % to 1 %
_MIN_SAMPLE = 1 << 14
_OVERSHOOT = 1.25  # aim the threshold at 1.25 k candidates, so fewer than k is rare
_GROUP = 16

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

    Small tensors go through `torch.topk`. Large ones follow Deep Gradient Compression (Lin et
    al. 2018, https://arxiv.org/abs/1712.01887, section 3.4): the threshold is estimated on a
    strided 1 % sample, aimed a little low, and one pass keeps the candidates above it; the
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
        return torch.sort(torch.topk(flat.abs().float(), k, sorted=False).indices).values
    scratch = scratch or Scratch()
    stride = max(1, int(1 / _SAMPLE_SHARE))
    m = -(-n // stride)
    if m < _MIN_SAMPLE:
        stride = max(1, n // _MIN_SAMPLE)
        m = -(-n // stride)
    sample = flat[::stride].abs().float()
    for overshoot in (_OVERSHOOT, 4 * _OVERSHOOT):
        rank = min(m, max(1, math.ceil(k * m / n * overshoot)))
        threshold = float(torch.topk(sample, rank, sorted=False).values.min())
        cands = _above(flat, threshold, scratch)
        if cands.numel() >= k:
            mags = flat[cands].abs().float()
            keep = torch.topk(mags, k, sorted=False).indices
            return torch.sort(cands[keep]).values
    return torch.sort(torch.topk(flat.abs().float(), k, sorted=False).indices).values


def _above(flat: torch.Tensor, threshold: float, scratch: Scratch) -> torch.Tensor:
    """Positions (int64, in no particular order) of the entries with |x| >= threshold.

    Comparing into bool and `nonzero` cost 10x an fp32 `abs` per value here, so they only
    run on the groups whose largest magnitude reaches the threshold (about a fifth of them
    when 1 % of the values do). A chunk is viewed as 16 rows; group j is column j, whose max
    over the rows is one vectorised pass (a max over rows of 16 adjacent values took 17x
    longer).
    """
    found = []
    for lo, hi in spans(flat.numel()):
        work = torch.abs(flat[lo:hi], out=scratch.get(flat.dtype, hi - lo))
        if not bool(torch.isfinite(work.sum())):  # |x| summed in cache: NaN/Inf shows here
            raise ValueError("topk: cannot encode a tensor holding NaN or Inf")
        whole = (hi - lo) // _GROUP * _GROUP
        rows = work[:whole].view(_GROUP, -1)
        hot = (rows.amax(dim=0) >= threshold).nonzero().view(-1)
        if hot.numel():
            at = (rows.index_select(1, hot) >= threshold).nonzero()
            found.append((at[:, 0] * rows.shape[1] + hot[at[:, 1]]).add_(lo))
        tail = (work[whole:] >= threshold).nonzero().view(-1)
        if tail.numel():
            found.append(tail.add_(lo + whole))
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)


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
        self._scratch = Scratch()

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
        idx = topk_indices(flat, k, self._scratch)
        values = flat[idx].float()
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
        out = into(out, n).zero_()
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
