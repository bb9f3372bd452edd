"""Silent restart from initial values: a shard that lost every replica, with no checkpoint, starts over.

Issue 15, through the CLI: "1 shard without backup or checkpoints, killed at 30%: the event said
'restored from (none: initial values) ... at least 5747 version(s) lost', yet the finished
experiment's versions_lost metric read 0". Here: coordinator, 2 on-demand nodes (the shard's and
a spare) and 1 spot worker, async digits, 3,000 steps, no backup, no checkpoints; the shard's
node is killed (kill -9) at 30%.
PASS: the shard is not restarted from its initial values: it is rebuilt from a copy and the
experiment's versions_lost metric carries at least what the restore's event says was lost, or
the experiment fails saying why.
"""

from __future__ import annotations

import re
import time

from _common import Outcome, cluster, digits_experiment, main, ps_roles, wait_for, wait_running

NAME = "silent_restart"
TOTAL = 3000


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        c.add_nodes(["ps0", "ps1"], ["w0"])
        job = c.submit(digits_experiment(NAME, total_steps=TOTAL, checkpoint_every=0))
        st = wait_running(job, steps=int(0.3 * TOTAL))
        host = ps_roles(st)[0]["node"]  # the other on-demand node is the spare
        killed_at = st["steps"]
        t_kill = time.time()
        c.lc.kill_node(host)
        final = wait_for(lambda: (s := job.status())["state"] in ("completed", "failed", "cancelled") and s,
                         400, "the experiment to finish")
        events = [e for e in job.events(since_unix=t_kill - 1) if e["kind"] in ("restore", "restored", "failed",
                                                                                   "warning", "degraded")]
    restored = [e["message"] for e in events if e["kind"] == "restored"]
    lost_metric = final["metrics"].get("versions_lost", 0)
    from_initial = any("initial values" in m for m in restored)
    if final["state"] == "failed":
        passed = bool(final["message"])
    else:
        # The restore's event says how many versions were lost at least; the metric must carry them.
        said = max((int(m.group(1)) for r in restored if (m := re.search(r"at least (\d+) version", r))), default=0)
        passed = bool(restored) and not from_initial and lost_metric >= said
    figure = (f"killed at step {killed_at}; {final['state']} ({final['message'][:90]}); restored: "
              f"{restored[0][:140] if restored else 'no restored event'}; versions_lost metric {lost_metric:g}")
    return Outcome(NAME, passed, figure, {"events": events, "metrics": final["metrics"], "steps": final["steps"]})


if __name__ == "__main__":
    main(NAME, run)
