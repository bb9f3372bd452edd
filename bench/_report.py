"""Shared writer of benchmark results: a JSON file and a markdown table, with the commit, machine and load they ran on."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import time
from typing import Any

BENCH = pathlib.Path(__file__).resolve().parent
#: The record: one current pair per script, <script>.json and <script>.md.
RESULTS = BENCH / "results"
#: Labelled and A/B runs (git-ignored): <script>_<label>.json and .md.
OUT = BENCH / "out"

# Taken when the bench imports this module, which each does first thing: the load the run started under.
_LOAD_AT_START = os.getloadavg()


def report_path(name: str, label: str | None = None, out_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The JSON file a run of `name` writes: results/<name>.json, or out/<name>_<label>.json for a labelled run.

    `out_dir`, where given, replaces the folder (the file keeps its name).
    """
    stem = name if label is None else f"{name}_{label}"
    folder = out_dir if out_dir is not None else RESULTS if label is None else OUT
    return pathlib.Path(folder) / f"{stem}.json"


def plot_path(name: str) -> pathlib.Path:
    """Where a script draws its plot: out/<name>.png (git-ignored: results/ holds only the JSON and markdown)."""
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT / f"{name}.png"


def _git_commit() -> str:
    """HEAD of the tree the bench runs from, with `+dirty` where tracked files other than results/ differ from it.

    results/ is left out: a script that writes its result after each part would otherwise call its own
    earlier writes a change to the code it measures.
    """
    try:
        head = subprocess.run(["git", "-C", str(BENCH), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(BENCH.parent), "status", "--porcelain", "--untracked-files=no",
                                "--", ".", f":(exclude){RESULTS.relative_to(BENCH.parent)}"],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def run_record() -> dict[str, Any]:
    """What a result was measured on: the commit, the machine, and the load average (1, 5, 15 min) at start and end."""
    return {
        "commit": _git_commit(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
                    "memory_gib": _memory_gib()},
        "load_start": [round(x, 2) for x in _LOAD_AT_START],
        "load_end": [round(x, 2) for x in os.getloadavg()],
    }


def record_line(record: dict[str, Any]) -> str:
    """The markdown header line of a run record."""
    m = record["machine"]
    start, end = (" / ".join(f"{x:.2f}" for x in record[k]) for k in ("load_start", "load_end"))
    return (f"_Commit {record['commit']}; {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB; "
            f"load average (1 / 5 / 15 min) {start} at start, {end} at end._")


def _atomic_write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(
    name: str, rows: list[dict[str, Any]], notes: str, out_dir: pathlib.Path | None = None,
    label: str | None = None,
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write the JSON and markdown of a run (at `report_path(name, label, out_dir)`); returns both paths."""
    js = report_path(name, label, out_dir)
    js.parent.mkdir(parents=True, exist_ok=True)
    record = run_record()
    meta = {
        "name": name,
        "label": label,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        **record,
    }
    _atomic_write(js, json.dumps({**meta, "notes": notes, "rows": rows}, indent=2) + "\n")
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    title = name if label is None else f"{name} ({label})"
    lines = [
        f"# {title}",
        "",
        f"_{meta['time']}, Python {meta['python']}._",
        record_line(record),
        "",
        notes,
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    for row in rows:
        cells = []
        for c in cols:
            v = row.get(c, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    md = js.with_suffix(".md")
    _atomic_write(md, "\n".join(lines))
    return js, md
