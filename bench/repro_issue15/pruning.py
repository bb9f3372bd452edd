"""Lost nodes and finished experiments are never pruned: the coordinator's state only grows.

Issue 15 ("Smaller"): "lost nodes and finished experiments are never pruned". Here: `coordinator
serve --help` is searched for retention flags; a coordinator is started with the short periods
they allow (3 s for lost nodes and finished experiments) or, where there are none, as is. One
node joins and is killed (kill -9; lost after the 5 s lease), one experiment is submitted and
cancelled. PASS: the flags exist and within 60 s of both being gone the node is no longer listed
and the experiment no longer listed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from _common import LOG_ROOT, Outcome, digits_experiment, main, wait_for

NAME = "pruning"
FLAGS = ("--lost-node-retention", "--finished-retention")
WATCH_S = 60.0


def run(label: str) -> Outcome:
    from gossamer.local_cluster import LocalCluster

    help_text = subprocess.run([sys.executable, "-m", "gossamer.cli", "coordinator", "serve", "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    present = [f for f in FLAGS if f in help_text]
    args = [a for f in present for a in (f, "3")]
    with tempfile.TemporaryDirectory(prefix="repro15-") as tmp:
        lc = LocalCluster(tmp, log_dir=LOG_ROOT / label / NAME, heartbeat_interval=0.5, lease_timeout=5.0,
                          coordinator_args=args)
        try:
            lc.start_coordinator(port=0)
            client = lc.client()
            lc.add_node("n0")
            wait_for(lambda: any(n["name"] == "n0" and n["state"] in ("ready", "busy") for n in client.nodes()), 120,
                     "n0 to join")
            job = client.submit(digits_experiment(NAME))
            job.cancel()
            lc.kill_node("n0")
            wait_for(lambda: all(n["state"] not in ("ready", "busy") for n in client.nodes() if n["name"] == "n0"), 60,
                     "n0 to be lost")
            wait_for(lambda: job.status()["state"] == "cancelled", 60, "the experiment to be cancelled")
            t0 = time.monotonic()
            listed = (1, 1)

            def gone() -> bool:
                nonlocal listed
                listed = (sum(n["name"] == "n0" for n in client.nodes()),
                          sum(e["id"] == job.id for e in client.experiments()))
                return listed == (0, 0)

            try:
                wait_for(gone, WATCH_S, "the lost node and the finished experiment to be pruned", every=1.0)
            except TimeoutError:
                pass
            waited = time.monotonic() - t0
            client.close()
        finally:
            lc.close()
    passed = len(present) == len(FLAGS) and listed == (0, 0)
    figure = (f"retention flags in `coordinator serve --help`: {present or 'none'}; {waited:.0f} s after the node was "
              f"lost and the experiment cancelled: {listed[0]} lost node and {listed[1]} finished experiment listed")
    return Outcome(NAME, passed, figure, {"flags": present, "listed": listed, "waited_s": round(waited, 1)})


if __name__ == "__main__":
    main(NAME, run)
