"""`python -m bench.intranode --quick` runs end to end and reports every section with finite numbers."""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bench_intranode_quick_reports_every_section_and_fsdp_uses_less_memory_than_ddp(
    tmp_path: pathlib.Path,
) -> None:
    # own session, so a timeout kills the bench and the ranks it spawned (by process group id)
    proc = subprocess.Popen([sys.executable, "-m", "bench.intranode", "--quick", "--out", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, out[-4000:]
    report = json.loads((tmp_path / "intranode.json").read_text())
    assert (tmp_path / "intranode.md").read_text().startswith("# intranode")
    rows = report["rows"]
    by_section: dict[str, list[dict]] = {}  # type: ignore[type-arg]
    for row in rows:
        by_section.setdefault(row["section"], []).append(row)
        for key in ("measured", "reference", "ratio"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), row
    assert set(by_section) == {"memory", "bubble", "throughput", "loss"}

    memory = {r["layout"]: r["measured"] for r in by_section["memory"]}
    assert set(memory) == {"single", "ddp", "fsdp", "pipeline"}
    assert 0 < memory["fsdp"] < memory["ddp"], memory

    bubbles = {r["layout"]: r for r in by_section["bubble"]}
    assert {f"GPipe p=2 m={m}" for m in (1, 2, 4, 8)} <= set(bubbles)
    assert {f"1F1B p=2 m={m}" for m in (2, 4, 8)} <= set(bubbles)
    for r in bubbles.values():
        assert 0 <= r["measured"] < 1, r
        m = int(r["layout"].rsplit("m=", 1)[1])
        assert r["reference"] == pytest.approx(1 / (m + 1)), r

    throughput = {r["layout"]: r["measured"] for r in by_section["throughput"]}
    assert set(throughput) == {"single (start)", "single (end)", "ddp x2", "fsdp x2", "GPipe p=2 m=4", "1F1B p=2 m=4"}
    assert all(v > 0 for v in throughput.values()), throughput

    # every layout trains the same weights on the same batches: the first-step losses agree
    for r in by_section["loss"]:
        assert r["ratio"] == pytest.approx(1.0, abs=1e-4), r
