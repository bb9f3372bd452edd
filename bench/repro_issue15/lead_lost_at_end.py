"""The lead lost at the end never completes: nobody takes over the final evaluation and checkpoint.

Issue 15, through the CLI: "1 shard, 3 workers, 4,000 steps, the lead worker's node killed with
kill -9 at step ~3,900: the shard reached 4,000/4,000 ... the experiment stayed RUNNING at
4000/4000". Here: 1 shard, 3 spot workers slowed to 100 ms a step (GOSSAMER_FAULT delay), 600
steps. At 90% the lead's node (worker 0: its agent and role process) is frozen (SIGSTOP), so it
is lost only when its 5 s lease runs out (a kill -9 closes its streams at once, and the
coordinator then names a new lead before the others finish: at 91% the old tree completed);
the other two finish the steps meanwhile, and 10 s after the freeze the frozen node is killed
(kill -9). PASS: the experiment completes within 180 s of the kill.
"""

from __future__ import annotations

import os
import signal
import time

from _common import Outcome, cluster, digits_experiment, main, wait_for

NAME = "lead_lost_at_end"
TOTAL = 600
SLOW = {"GOSSAMER_FAULT": "delay:seconds=0.1"}


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        c.add_nodes(["ps"])
        for name in ("w0", "w1", "w2"):  # joined in order: w0 is worker 0, the lead
            c.lc.add_node(name, spot=True, env=SLOW)
            c.wait_nodes(2 + int(name[1]))
        job = c.submit(digits_experiment(NAME, total_steps=TOTAL, min_workers=3, max_workers=3, momentum=0.5))
        st = wait_for(lambda: (s := job.status())["state"] == "running" and len(
            [r for r in s["roles"] if r["role"] == "worker"]) == 3 and s, 180, "3 workers running")
        workers = sorted((r for r in st["roles"] if r["role"] == "worker"), key=lambda r: r["index"])
        lead = workers[0]["node"]
        st = wait_for(lambda: (s := job.status())["steps"] >= 0.9 * TOTAL and s, 300, "90% of the steps", every=0.05)
        killed_at = st["steps"]
        os.killpg(c.lc.nodes[lead].pid, signal.SIGSTOP)
        time.sleep(10.0)
        c.lc.kill_node(lead)
        t0 = time.monotonic()
        try:
            final = wait_for(lambda: (s := job.status())["state"] in ("completed", "failed", "cancelled") and s,
                             180, "the experiment to finish")
        except TimeoutError:
            final = job.status()
        took = time.monotonic() - t0
        events = [f"{e['kind']}: {e['message'][:120]}" for e in job.events()][-10:]
        if final["state"] == "running":
            job.cancel()
    passed = final["state"] == "completed"
    figure = (f"lead {lead} frozen at {killed_at}/{TOTAL}, killed 10 s later; {took:.0f} s after the kill: {final['state']} at "
              f"{final['steps']}/{TOTAL} {final['message'][:80]}")
    return Outcome(NAME, passed, figure, {"events": events})


if __name__ == "__main__":
    main(NAME, run)
