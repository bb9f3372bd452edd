"""Checkpoint write failures are only a metric: no event, nothing in `gossamer status`.

Issue 15 ("Smaller"): "checkpoint write failures are only a metric". Here: coordinator, an
on-demand node (the shard) and a spot worker, async digits checkpointing every 50 steps into a
directory of its own. After the first checkpoint the directory is moved away and a plain file
put at its path, so every later write fails. Then, up to 120 s: the `ckpt_failed` metric, the
experiment's events, and `python -m gossamer.cli status ID`. PASS: an event says a checkpoint
write failed and `gossamer status` shows the failures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from _common import Outcome, cluster, digits_experiment, main, wait_for, wait_running

NAME = "ckpt_failures"


def _fail_event(e: dict) -> bool:  # type: ignore[type-arg]
    # The experiment is named "ckptw": no "fail" in its checkpoint paths.
    text = f"{e['kind']} {e['message']}".lower()
    return "checkpoint" in text and ("fail" in text or "error" in text)


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        ckpt = Path(c._tmp.name) / "ckpt"
        c.add_nodes(["ps0"], ["w0"])
        job = c.submit(digits_experiment("ckptw", checkpoint_every=50, checkpoint_dir=str(ckpt)))
        wait_running(job, steps=10)
        # On disk, not from the status: a shard checkpoint is not every tree's `checkpoint` field.
        wait_for(lambda: any(ckpt.rglob("manifest.json")), 240, "the first checkpoint on disk", every=1.0)
        os.replace(ckpt, ckpt.with_name("ckpt-moved"))
        ckpt.write_text("not a directory\n")
        t_break = time.time()
        steps_then = job.status()["steps"]

        def observed() -> tuple[float, list[dict]]:  # type: ignore[type-arg]
            failed = float(job.status()["metrics"].get("ckpt_failed", 0))
            events = [e for e in job.events(since_unix=t_break - 1) if _fail_event(e)]
            return failed, events

        try:
            wait_for(lambda: (o := observed())[0] >= 1 and o[1], 120, "a failed checkpoint write event")
        except TimeoutError:
            pass
        failed, events = observed()
        st = job.status()
        out = subprocess.run([sys.executable, "-m", "gossamer.cli", "status", "--coordinator", c.lc.address,
                              *c.lc.client_args, job.id], capture_output=True, text=True, timeout=120)
        job.cancel()
    shown = [ln.strip() for ln in out.stdout.splitlines() if "checkpoint" in ln.lower() and "fail" in ln.lower()]
    passed = bool(events) and bool(shown)
    figure = (f"dir replaced by a file at step {steps_then}; {st['steps'] - steps_then} steps later ckpt_failed="
              f"{failed:.0f}, {len(events)} failure event(s)"
              f"{' (' + events[0]['message'][:90] + ')' if events else ''}; `gossamer status`: "
              f"{shown[0][:80] if shown else 'says nothing of it'}")
    return Outcome(NAME, passed, figure, {"ckpt_failed": failed, "events": events[:3], "status_lines": shown,
                                          "status_rc": out.returncode, "status_err": out.stderr[-500:]})


if __name__ == "__main__":
    main(NAME, run)
