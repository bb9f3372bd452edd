"""Run inside the coordinator's namespace by test_partition_fencing: submit the run, then write its status,
events and (at the end) metrics to a JSON file the test reads from outside the namespaces."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from gossamer import Client


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    out = Path(args.out)
    client = Client(args.coordinator)
    deadline = time.monotonic() + args.timeout
    while sum(n["state"] == "ready" for n in client.nodes()) < args.nodes:
        if time.monotonic() > deadline:
            _write(out, {"error": f"fewer than {args.nodes} nodes joined", "nodes": client.nodes()})
            return
        time.sleep(0.2)
    job = client.submit(json.loads(args.spec))
    while time.monotonic() < deadline:
        st = job.status()
        doc: dict[str, Any] = {"status": st, "events": job.events(), "nodes": client.nodes()}
        if st["state"] not in ("queued", "starting", "running"):
            doc["metrics"] = st.get("metrics", {})
            doc["series"] = job.metrics()
            doc["final"] = True
            _write(out, doc)
            return
        _write(out, doc)
        time.sleep(0.2)
    _write(out, {"error": "timed out", "status": job.status(), "events": job.events()})


if __name__ == "__main__":
    main()
