"""bench/wan.py's pure parts: repeated runs merged by (case, rate, mode, run), medians and spreads per cell."""

from __future__ import annotations

import pytest

from bench._wan_stats import cell_stats, fmt_cell, median, merge_runs, run_key, spread, summarise


def _run(mode: str, k: int, tt: float | None, acc: float, case: str = "normal", status: str = "completed",
         load: float = 1.0) -> dict:
    fig = {"reached": tt is not None, "final_acc": acc, "samples_per_s": 100.0 + k, "wire_MB": 10.0}
    if tt is not None:
        fig["tt_target_s"] = tt
    return {"case": case, "rate": "100mbit", "mode": mode, "run": k, "status": status, "fig": fig,
            "loadavg": [load, load + 1]}


def test_median_and_spread_skip_missing_and_nan() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5
    assert median([float("nan"), None, 5.0]) == 5.0  # type: ignore[list-item]
    assert median([]) is None
    assert spread([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert spread([float("nan")]) is None


def test_merge_replaces_same_key_and_appends_the_rest() -> None:
    old = [_run("ddp", 0, 10, 0.9), _run("gossip", 0, 5, 0.9), _run("ddp", 1, 11, 0.9)]
    new = [_run("gossip", 0, 4, 0.95), _run("gossip", 1, 6, 0.9), _run("ddp", 0, 9, 0.9, case="straggler")]
    merged = merge_runs(old, new)
    assert [run_key(r) for r in merged] == [
        ("normal", "100mbit", "ddp", 0), ("normal", "100mbit", "gossip", 0), ("normal", "100mbit", "ddp", 1),
        ("normal", "100mbit", "gossip", 1), ("straggler", "100mbit", "ddp", 0)]
    assert merged[1]["fig"]["tt_target_s"] == 4  # the new run replaced the stored one
    with pytest.raises(ValueError):
        merge_runs([], [_run("ddp", 0, 1, 0.9), _run("ddp", 0, 2, 0.9)])


def test_run_recorded_before_repeats_is_normal_run_0() -> None:
    assert run_key({"rate": "1gbit", "mode": "sync"}) == ("normal", "1gbit", "sync", 0)


def test_cell_stats_count_unreached_and_failed_runs() -> None:
    runs = [_run("async", 0, 30, 0.95), _run("async", 1, None, 0.94), _run("async", 2, 20, 0.96),
            _run("async", 3, 1, 0.1, status="failed", load=7.0)]
    st = cell_stats(runs)
    assert (st["runs"], st["completed"], st["reached"], st["all_reached"]) == (4, 3, 2, False)
    assert st["tt_target_s"] == 25 and st["tt_target_s_spread"] == (20, 30)  # over the runs that reached
    assert st["final_acc"] == 0.95 and st["final_acc_spread"] == (0.94, 0.96)  # the failed run left out
    assert st["loadavg_spread"] == (1.0, 8.0)  # every run's load, the failed one's too


def test_ratios_are_of_medians_per_case() -> None:
    runs = [_run("ddp", k, tt, 0.97) for k, tt in enumerate([40, 44, 60])]
    runs += [_run("gossip", k, tt, 0.96) for k, tt in enumerate([20, 22, 11])]
    runs += [_run("ddp", 0, 100, 0.97, case="straggler"), _run("gossip", 0, 25, 0.97, case="straggler")]
    stats = summarise(runs)
    g = stats[("normal", "100mbit", "gossip")]
    assert g["speedup_to_target"] == pytest.approx(44 / 20)
    assert g["speedup_to_target_spread"] == pytest.approx((44 / 22, 44 / 11))
    assert g["final_acc_delta_points"] == pytest.approx(-1.0)
    assert stats[("straggler", "100mbit", "gossip")]["speedup_to_target"] == pytest.approx(4.0)
    assert stats[("normal", "100mbit", "ddp")]["speedup_to_target"] == pytest.approx(1.0)


def test_fmt_cell() -> None:
    assert fmt_cell(None, None) == ""
    assert fmt_cell(2.0, (2.0, 2.0), 1) == "2.0"
    assert fmt_cell(2.25, (1.5, 3.0), 2, "x") == "2.25x [1.50-3.00]"
