"""Runs the reproductions of issue 15's "Why" against the `gossamer` first on PYTHONPATH; PASS = the hardening holds.

    PYTHONPATH=$PWD python bench/repro_issue15/run.py [--only NAME[,NAME]] [--label LABEL]
    git worktree add /tmp/old912 912ec8e   # the tree the issue was filed against
    PYTHONPATH=/tmp/old912 python bench/repro_issue15/run.py --label old912

Each reproduction runs in its own process (its own cluster); the verdicts go to
bench/results/repro_issue15.json (keyed by label, so runs against different trees sit side by
side) and a markdown table in bench/results/repro_issue15.md. Each one starts its own local
cluster (a coordinator and 2-4 nodes) from an empty working directory, so the nodes import the
same gossamer as the runner; floods stop once the shard grew 1 GB. The first eleven take about
20 min on a loaded 2-core machine, the last seven (the rest of "Smaller" and STARTING forever)
about 8 min more.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
#: One script per bullet of the issue's "Why", in its order.
REPRODUCTIONS = [
    "unbounded_queues", "pull_views", "backup_stall", "unbound_messages", "stray_hello_wedge",
    "silent_restart", "partition_fencing", "lead_lost_at_end", "everything_leaves", "smaller",
    # Not a bullet: a bug of main found while reproducing everything_leaves (see its docstring).
    "resume_before_shard_serves",
    # The rest of "Smaller" and "STARTING forever", cheapest first.
    "import_checks", "dcp_metadata", "ckpt_failures", "pruning", "metric_series", "starting_forever",
    "final_ckpt_replace",
]


def tree_label() -> str:
    """The tested tree: its git commit (short) and whether it is the lead's main or an old one."""
    import gossamer

    root = Path(gossamer.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "unknown"
    return f"{head} ({root})"


def run_one(name: str, label: str, timeout: float) -> dict:  # type: ignore[type-arg]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    t0 = time.monotonic()
    cmd = [sys.executable, str(HERE / f"{name}.py"), "--label", label, "--json", str(out)]
    try:
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True, start_new_session=True)
        tail = (proc.stdout + proc.stderr)[-3000:]
        result = json.loads(out.read_text()) if out.stat().st_size else None
    except subprocess.TimeoutExpired as e:
        tail, result = f"timed out after {timeout:.0f}s: {e}", None
    finally:
        out.unlink(missing_ok=True)
    if result is None:
        result = {"name": name, "result": "ERROR", "figure": "the reproduction did not finish", "details": {"log": tail}}
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result


def write_results(label: str, results: list[dict]) -> None:  # type: ignore[type-arg]
    RESULTS.mkdir(exist_ok=True)
    # Runs against two trees may finish together: one read-modify-write at a time.
    with open(Path(tempfile.gettempdir()) / "repro_issue15.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _merge(label, results)


def _merge(label: str, results: list[dict]) -> None:  # type: ignore[type-arg]
    path = RESULTS / "repro_issue15.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    runs = data.setdefault("runs", {})
    mine = runs.setdefault(label, {})
    for r in results:
        mine[r["name"]] = r
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    labels = list(runs)
    lines = ["# Issue 15 reproductions", "",
             "PASS: the hardening holds (the reproduction of the issue's \"Why\" no longer works); FAIL: it "
             "reproduces. Rerun: `PYTHONPATH=<tree> python bench/repro_issue15/run.py [--only NAME]`.", "",
             "| reproduction | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in REPRODUCTIONS:
        cells = []
        for lab in labels:
            r = runs[lab].get(name)
            cells.append("-" if r is None else f"**{r['result']}** {r['figure']}".replace("|", "/"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (RESULTS / "repro_issue15.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated names (default: all): " + ", ".join(REPRODUCTIONS))
    p.add_argument("--label", default="", help="the column name in the results (default: the tree's git commit)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per reproduction")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or REPRODUCTIONS
    unknown = [n for n in names if n not in REPRODUCTIONS]
    if unknown:
        p.error(f"unknown reproduction(s) {unknown}; known: {REPRODUCTIONS}")
    label = args.label or tree_label()
    os.environ.setdefault("REPRO_LOG_ROOT", "/tmp/repro_issue15")
    results = []
    for name in names:
        r = run_one(name, label, args.timeout)
        print(f"{r['result']:5} {name}: {r['figure']} ({r['seconds']:.0f}s)", flush=True)
        results.append(r)
    write_results(label, results)
    return 0 if all(r["result"] in ("PASS", "SKIP") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
