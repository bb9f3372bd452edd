"""One stray message wedges a run for good: a HELLO to the backup's endpoint stops all progress.

Issue 15, tried through the CLI: "coordinator, 2 on-demand and 3 spot nodes, async digits, one
HELLO sent to the backup's endpoint by a plain ZMQ DEALER": the backup promoted itself, the
primary detached it and its serve thread died, every worker then failed after 60 s and was
respawned, and the experiment stayed RUNNING with no progress. Here: the same cluster with 2
spot workers; one HELLO to the backup, then the experiment's steps are watched for 150 s.
PASS: the run keeps making progress (at least 200 steps more, no stall of 60 s or longer).
"""

from __future__ import annotations

import time

from _common import (
    Outcome,
    Stranger,
    cluster,
    digits_experiment,
    frames,
    main,
    ps_roles,
    stats,
    wait_for,
    wait_running,
)

NAME = "stray_hello_wedge"
WATCH_S = 150.0
STALL_S = 60.0


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        c.add_nodes(["ps0", "ps1"], ["w0", "w1"])
        job = c.submit(digits_experiment(NAME, ps_backup=True, min_workers=2, max_workers=2))
        st = wait_running(job, steps=100, replicas=2)
        roles = ps_roles(st)
        s = Stranger()
        try:
            wait_for(lambda: stats(s, roles[0]["endpoint"], job.id)["replicated"], 60, "the backup to sync")
            head, _ = s.ask(roles[1]["endpoint"], frames("HELLO", job.id, 0, "stranger", {"rid": 1}))
        finally:
            s.close()
        t0 = time.monotonic()
        start_steps = job.status()["steps"]
        last_steps, last_change, longest = start_steps, t0, 0.0
        while time.monotonic() - t0 < WATCH_S:
            st = job.status()
            now = time.monotonic()
            if st["steps"] != last_steps:
                last_steps, last_change = st["steps"], now
            longest = max(longest, now - last_change)
            if st["state"] != "running":
                break
            time.sleep(1.0)
        events = [f"{e['kind']}: {e['message'][:100]}" for e in job.events()
                  if e["kind"] in ("promote", "degraded", "replicated", "lost", "restore", "stalled", "warning")]
        job.cancel()
    gained = last_steps - start_steps
    passed = gained >= 200 and longest < STALL_S
    figure = (f"HELLO answered {head['op']}; {gained} steps in the {time.monotonic() - t0:.0f} s after it, longest "
              f"stall {longest:.0f} s, state {st['state']} {st['message'][:80]}")
    return Outcome(NAME, passed, figure, {"reply": head["meta"], "events": events[-12:],
                                          "steps_before": start_steps, "steps_after": last_steps})


if __name__ == "__main__":
    main(NAME, run)
