"""Failed import checks are neither cached nor capped: every submit of a broken experiment starts a child interpreter.

Issue 15 ("Smaller"): "failed import checks are neither cached nor capped". Here: a coordinator
alone (no nodes); the same experiment, whose model module does not exist, is submitted 12 times
at once and then 12 times one after the other, every submit refused. A sampler counts the
coordinator's child processes running an import check (`gossamer._import_check` in the command
line, or any new child of a forked checker). PASS: at most 3 checks were started for the 24
submits and at most 3 ran at once (main caches a failure per code paths and caps concurrency).
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from pathlib import Path

from _common import LOG_ROOT, Outcome, digits_experiment, main

NAME = "import_checks"
BURST = 12
MAX_STARTED = 3


def _children(root: int) -> dict[int, str]:
    """Every descendant of `root`: pid -> command line."""
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (proc / "stat").read_text()
            parent[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            cmd[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    out = {}
    for pid in parent:
        p, seen = parent.get(pid), 0
        while p and p != root and seen < 64:
            p, seen = parent.get(p), seen + 1
        if p == root:
            out[pid] = cmd[pid]
    return out


def run(label: str) -> Outcome:
    from gossamer.local_cluster import LocalCluster

    exp = digits_experiment(NAME, model="repro15_no_such_module:mlp")
    with tempfile.TemporaryDirectory(prefix="repro15-") as tmp:
        lc = LocalCluster(tmp, log_dir=LOG_ROOT / label / NAME)
        try:
            lc.start_coordinator(port=0)
            coord = lc.coordinator.pid
            before = set(_children(coord))
            seen: dict[int, str] = {}
            peak = 0
            stop = threading.Event()

            def sample() -> None:
                nonlocal peak
                while not stop.is_set():
                    now = {p: c for p, c in _children(coord).items() if p not in before}
                    seen.update(now)
                    peak = max(peak, sum("_import_check" in c or "forkserver" not in c for c in now.values()))
                    time.sleep(0.005)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            errors: list[str] = []

            def submit_once() -> None:
                client = lc.client()
                try:
                    client.submit(exp)
                    errors.append("ACCEPTED")
                except Exception as e:  # noqa: BLE001 - the refusal is what we expect
                    errors.append(f"{type(e).__name__}: {e}")
                finally:
                    client.close()

            t0 = time.monotonic()
            threads = [threading.Thread(target=submit_once) for _ in range(BURST)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            burst_s = time.monotonic() - t0
            t1 = time.monotonic()
            for _ in range(BURST):
                submit_once()
            serial_s = time.monotonic() - t1
            time.sleep(0.5)
            stop.set()
            sampler.join()
        finally:
            lc.close()
    checks = {p: c for p, c in seen.items() if "_import_check" in c or "forkserver" not in c}
    started = len(checks)
    refused = sum(e != "ACCEPTED" for e in errors)
    passed = started <= MAX_STARTED and peak <= MAX_STARTED and refused == 2 * BURST
    figure = (f"{2 * BURST} submits of a broken model ({refused} refused) started {started} import-check "
              f"process(es), {peak} at once; burst {burst_s:.1f} s, {BURST} serial {serial_s:.1f} s")
    return Outcome(NAME, passed, figure, {"started": started, "peak": peak, "refused": refused,
                                          "first_error": errors[0][:300] if errors else "",
                                          "children": sorted(set(checks.values()))[:5],
                                          "burst_s": round(burst_s, 2), "serial_s": round(serial_s, 2)})


if __name__ == "__main__":
    main(NAME, run)
