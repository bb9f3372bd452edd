"""Pure parts of bench/wan.py: repeated runs merged by key, and each (case, rate, mode) cell's median and spread."""

from __future__ import annotations

import math
import statistics
from typing import Any

#: Per-run figures summarised per cell (median and min-max over the runs that have them).
FIGURES = ("samples_per_s", "tt_target_s", "tt_target_e2e_s", "final_acc", "best_acc", "wire_MB",
           "wire_MB_to_target")

Key = tuple[str, str, str, int]
Cell = tuple[str, str, str]


def run_key(run: dict[str, Any]) -> Key:
    """(case, rate, mode, run index) of one run; runs recorded before repeats count as case 'normal', run 0."""
    return (run.get("case", "normal"), run["rate"], run["mode"], int(run.get("run", 0)))


def cell_of(run: dict[str, Any]) -> Cell:
    case, rate, mode, _ = run_key(run)
    return case, rate, mode


def merge_runs(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`old` with every run whose key is in `new` replaced by the new one, other new runs appended.

    Order: old runs in their order (a replaced one in its place), then the new ones not replacing any.
    """
    fresh = {run_key(r): r for r in new}
    if len(fresh) != len(new):
        raise ValueError("two new runs share a (case, rate, mode, run) key")
    out = [fresh.pop(run_key(r), r) for r in old]
    return out + [r for r in new if run_key(r) in fresh]


def median(xs: list[float]) -> float | None:
    """Median of the finite values of `xs` (None if none)."""
    vals = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return statistics.median(vals) if vals else None


def spread(xs: list[float]) -> tuple[float, float] | None:
    """(min, max) of the finite values of `xs` (None if none)."""
    vals = [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)]
    return (min(vals), max(vals)) if vals else None


def cell_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread of each figure over the completed runs of one cell, with run counts.

    A figure's median is over the runs that have it: `reached` says how many runs reached the target
    (the time-to-target median is over those only; `all_reached` is False when some did not).
    """
    done = [r for r in runs if r.get("status") == "completed"]
    figs = [r.get("fig") or {} for r in done]
    out: dict[str, Any] = {"runs": len(runs), "completed": len(done),
                           "reached": sum(bool(f.get("reached")) for f in figs)}
    out["all_reached"] = bool(done) and out["reached"] == len(done)
    for name in FIGURES:
        vals = [f[name] for f in figs if f.get(name) is not None]
        out[name] = median(vals)
        out[name + "_spread"] = spread(vals)
    loads = [x for r in runs for x in r.get("loadavg", [])]
    out["loadavg_spread"] = spread(loads)
    return out


def ratios(cell: dict[str, Any], ddp: dict[str, Any] | None) -> dict[str, Any]:
    """A cell against DDP's cell at the same (case, rate), from their medians.

    `speedup_to_target` is DDP's median time to target over this cell's; its spread divides DDP's
    median by this cell's slowest and fastest run. None where either side lacks the figure.
    """
    out: dict[str, Any] = {"speedup_to_target": None, "speedup_to_target_spread": None,
                           "samples_per_s_ratio": None, "bytes_ratio": None, "final_acc_delta_points": None}
    if not ddp:
        return out
    d_tt, tt, sp = ddp.get("tt_target_s"), cell.get("tt_target_s"), cell.get("tt_target_s_spread")
    if d_tt and tt:
        out["speedup_to_target"] = d_tt / tt
        if sp and sp[0] > 0:
            out["speedup_to_target_spread"] = (d_tt / sp[1], d_tt / sp[0])
    if cell.get("samples_per_s") and ddp.get("samples_per_s"):
        out["samples_per_s_ratio"] = cell["samples_per_s"] / ddp["samples_per_s"]
    if cell.get("wire_MB") and ddp.get("wire_MB"):
        out["bytes_ratio"] = cell["wire_MB"] / ddp["wire_MB"]
    if cell.get("final_acc") is not None and ddp.get("final_acc") is not None:
        out["final_acc_delta_points"] = 100 * (cell["final_acc"] - ddp["final_acc"])
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[Cell, dict[str, Any]]:
    """Every cell's stats and its ratios to DDP at the same (case, rate), in first-seen order."""
    by_cell: dict[Cell, list[dict[str, Any]]] = {}
    for r in runs:
        by_cell.setdefault(cell_of(r), []).append(r)
    stats = {c: cell_stats(rs) for c, rs in by_cell.items()}
    for (case, rate, _), s in stats.items():
        s.update(ratios(s, stats.get((case, rate, "ddp"))))
    return stats


def fmt_cell(value: float | None, rng: tuple[float, float] | None, d: int = 1, suffix: str = "") -> str:
    """'median [min-max]' ('' when there is no value; no range for a single value)."""
    if value is None:
        return ""
    if rng is None or rng[0] == rng[1]:
        return f"{value:.{d}f}{suffix}"
    return f"{value:.{d}f}{suffix} [{rng[0]:.{d}f}-{rng[1]:.{d}f}]"
