"""An experiment whose backup never syncs sits in STARTING forever, holding its nodes.

Issue 15 ("Everything leaves"): "an experiment whose backup never syncs sits in STARTING
forever, holding its nodes". Here: coordinator (leases of 600 s, so a stopped node stays
"ready"), 2 on-demand nodes and 1 spot worker, async digits with `ps_backup` (and
`start_timeout_s` 30 where the field exists). As soon as the shard's backup replica is assigned,
its node's agent and everything it started are stopped (SIGSTOP to its process group), so the
backup never starts and never syncs. PASS: within 150 s the experiment is out of STARTING,
running without the backup (a "degraded" event) or failed with the reason.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import time

from _common import LOG_ROOT, Outcome, digits_experiment, main, wait_for

NAME = "starting_forever"
START_TIMEOUT_S = 30.0
WATCH_S = 150.0


def run(label: str) -> Outcome:
    from gossamer.experiment import Experiment
    from gossamer.local_cluster import LocalCluster

    has_deadline = "start_timeout_s" in {f.name for f in dataclasses.fields(Experiment)}
    over = {"start_timeout_s": START_TIMEOUT_S} if has_deadline else {}
    stopped: list[int] = []
    with tempfile.TemporaryDirectory(prefix="repro15-") as tmp:
        lc = LocalCluster(tmp, log_dir=LOG_ROOT / label / NAME, heartbeat_interval=0.5, lease_timeout=600.0)
        try:
            lc.start_coordinator(port=0)
            client = lc.client()
            for n in ("ps0", "ps1"):
                lc.add_node(n)
            wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) >= 2, 120, "2 on-demand nodes")
            lc.add_node("w0", spot=True)
            wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) >= 3, 120, "3 nodes")
            job = client.submit(digits_experiment(NAME, ps_backup=True, **over))

            def backup_node() -> str | None:
                roles = job.status()["roles"]
                return next((r["node"] for r in roles if r["role"] == "ps" and r["replica"] == 1), None)

            node = wait_for(backup_node, 120, "the backup to be assigned", every=0.05)
            pgid = lc.nodes[node].pid
            os.killpg(pgid, signal.SIGSTOP)
            stopped.append(pgid)
            t0 = time.monotonic()
            state_then = job.status()["state"]
            try:
                wait_for(lambda: job.status()["state"] != "starting", WATCH_S, "STARTING to end", every=1.0)
            except TimeoutError:
                pass
            waited = time.monotonic() - t0
            st = job.status()
            events = [f"{e['kind']}: {e['message'][:100]}" for e in job.events()
                      if e["kind"] not in ("submit",)][-4:]
            nodes = {n["name"]: n["state"] for n in client.nodes()}
            job.cancel()
            client.close()
        finally:
            for g in stopped:
                os.killpg(g, signal.SIGCONT)
            lc.close()
    degraded = any("degraded" in e for e in events)
    out_of_starting = st["state"] != "starting"
    passed = out_of_starting and (st["state"] == "failed" and bool(st["message"]) or degraded)
    figure = (f"backup on {node} stopped while {state_then}; {waited:.0f} s later: {st['state']} at step {st['steps']}"
              f"{' (' + st['message'][:100] + ')' if st['message'] else ''}; "
              f"{'STARTING deadline field start_timeout_s=' + str(START_TIMEOUT_S) if has_deadline else 'no STARTING deadline field'}"
              f"; nodes {nodes}")
    return Outcome(NAME, passed, figure, {"state": st["state"], "message": st["message"], "events": events,
                                          "nodes": nodes, "has_deadline": has_deadline, "waited_s": round(waited, 1)})


if __name__ == "__main__":
    main(NAME, run)
