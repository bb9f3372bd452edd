"""Codec cost at size: encode + decode of N fp32 values against a memcpy of the same buffer, same run.

    python -m bench.codecs [--numel 100000000 | --quick] [--repeats 5] [--threads T]

Writes bench/results/codecs.{json,md} (a --label run: bench/out/codecs_<label>.{json,md}). Targets: int8/fp16/bf16/sign
at least 0.5x memcpy's throughput, top-k/random-k/PowerSGD at least 0.2x.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench._report import write_report
from gossamer.compression import _jit
from gossamer.compression.codec_spec import parse_codec

#: (spec, target ratio to memcpy), in the order of the table.
CODECS: tuple[tuple[str, float | None], ...] = (
    ("fp16", 0.5),
    ("bf16", 0.5),
    ("int8", 0.5),
    ("sign", 0.5),
    ("topk:0.01", 0.2),
    ("randk:0.01", 0.2),
    ("powersgd:4", 0.2),
    ("qsgd:127", None),
)
_COLS = 1024  # PowerSGD sees the values as a (numel / 1024) x 1024 matrix


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def _decode(codec: Any, payload: Any, shape: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
    try:
        return codec.decode(payload, shape, torch.float32, out=out)
    except TypeError:  # a gossamer before `Codec.decode(out=)` (run with PYTHONPATH=old checkout)
        return codec.decode(payload, shape, torch.float32)


def _measure(numel: int, repeats: int, only: set[str] | None = None) -> list[dict[str, Any]]:
    numel = numel // _COLS * _COLS
    x = torch.randn(numel) * 1e-3  # gradient-sized values
    dst = torch.empty_like(x)
    out = torch.empty_like(x)
    dst.copy_(x)
    out.copy_(x)  # both buffers faulted in before timing
    codecs = {spec: parse_codec(spec, seed=0) for spec, _ in CODECS if not only or spec in only}
    shapes = {spec: ((numel // _COLS, _COLS) if spec.startswith("powersgd") else (numel,)) for spec in codecs}
    samples: dict[str, list[tuple[float, float, float]]] = {spec: [] for spec in codecs}
    wire: dict[str, int] = {}
    clones: list[float] = []
    for rep in range(repeats + 1):  # the first round warms caches and allocator, not counted
        for spec, codec in codecs.items():
            gc.collect()
            memcpy_s, _ = _timed(lambda: dst.copy_(x))
            view = x.view(shapes[spec])
            t0 = time.perf_counter()
            payload = codec.encode(view, key="bench")
            t1 = time.perf_counter()
            _decode(codec, payload, shapes[spec], out)
            enc_s, dec_s = t1 - t0, time.perf_counter() - t1
            wire[spec] = payload.nbytes
            del payload
            if rep:
                samples[spec].append((memcpy_s, enc_s, dec_s))
        clone_s, copy = _timed(lambda: x.clone())
        del copy
        if rep:
            clones.append(clone_s)
    rows = []
    for spec, target in CODECS:
        if spec not in codecs:
            continue
        s = samples[spec]
        ratios = [m / (e + d) for m, e, d in s]
        ratio = statistics.median(ratios)
        rows.append(
            {
                "codec": spec,
                "numel": numel,
                "memcpy_ms": 1e3 * statistics.median(m for m, _, _ in s),
                "encode_ms": 1e3 * statistics.median(e for _, e, _ in s),
                "decode_ms": 1e3 * statistics.median(d for _, _, d in s),
                "ratio_to_memcpy": ratio,
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "target": "" if target is None else f">= {target}",
                "met": "" if target is None else ("yes" if ratio >= target else "NO"),
                "wire_ratio": 4 * numel / wire[spec],
            }
        )
    rows.append({"codec": "clone (alloc + copy)", "numel": numel,
                 "memcpy_ms": 1e3 * statistics.median(clones)})
    return rows


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--quick", action="store_true", help="10M values")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--only", default="", help="comma-separated specs to run (default: all)")
    ap.add_argument("--label", default=None, help="a labelled run: written to bench/out/codecs_<label>")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = 10_000_000 if args.quick else args.numel
    rows = _measure(numel, args.repeats, {c for c in args.only.split(",") if c} or None)
    notes = (
        f"encode + decode of {numel:,} fp32 values (randn * 1e-3; PowerSGD as a "
        f"{numel // _COLS} x {_COLS} matrix) against `dst.copy_(src)` of the same buffer into a "
        f"warm buffer, measured alternately in the same run; decode writes into a reused buffer "
        f"(`Codec.decode(out=)`); every round encodes with the same key, so fp16/bf16/int8 "
        f"write into the wire buffer of the previous round once it is dropped (`WirePool`), as "
        f"a training loop does from its second step. ratio_to_memcpy = memcpy time / (encode + decode time), "
        f"median of {args.repeats} rounds (min and max beside it). torch threads = "
        f"{torch.get_num_threads()}; codec kernels: "
        f"{'numba (compiled in the uncounted first round)' if _jit.available(numel) else 'torch only'}; "
        f"load average {_load()}."
    )
    js, md = write_report("codecs", rows, notes, args.out_dir, label=args.label)
    print(md.read_text())


if __name__ == "__main__":
    main()
