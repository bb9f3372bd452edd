"""Shared writer of benchmark results: a JSON file and a markdown table under bench/results/."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time
from typing import Any

RESULTS = pathlib.Path(__file__).parent / "results"


def _atomic_write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(
    name: str, rows: list[dict[str, Any]], notes: str, out_dir: pathlib.Path | None = None
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.md`` (default: results/); returns both paths."""
    out = RESULTS if out_dir is None else pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "name": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    js = out / f"{name}.json"
    _atomic_write(js, json.dumps({**meta, "notes": notes, "rows": rows}, indent=2) + "\n")
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    lines = [
        f"# {name}",
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
    lines += ["", f"_{meta['time']}, {meta['cpus']} CPUs, Python {meta['python']}_", ""]
    md = out / f"{name}.md"
    _atomic_write(md, "\n".join(lines))
    return js, md
