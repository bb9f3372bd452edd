"""No fencing under a partition: an isolated primary keeps acknowledging while its promoted backup does the same.

Issue 15: "an agent keeps its roles running when heartbeats fail (agent.py:277), so an isolated
primary may keep acknowledging while its promoted backup does the same". A one-sided partition
without network namespaces (tests/netns cuts a real link): the primary's node agent is frozen
(SIGSTOP), so its heartbeats stop and the coordinator promotes the backup, while the primary's
shard process runs on and stays reachable. Coordinator, 2 on-demand nodes, 1 spot worker.
PASS: once the backup is promoted, the old primary no longer acknowledges (it reports itself
fenced, or not primary, and applies nothing more).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from _common import (
    Outcome,
    Stranger,
    chunk_layout,
    cluster,
    digits_experiment,
    frames,
    main,
    ps_roles,
    stats,
    wait_for,
    wait_running,
)

NAME = "partition_fencing"


def _layout() -> dict[int, int]:
    from gossamer.experiment import Experiment

    return chunk_layout({}, 1, 0, Experiment.__dataclass_fields__["chunk_numel"].default)


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        c.add_nodes(["ps0", "ps1"], ["w0"])
        job = c.submit(digits_experiment(NAME, ps_backup=True))
        st = wait_running(job, steps=50, replicas=2)
        roles = ps_roles(st)
        old_ep = roles[0]["endpoint"]
        agent = c.lc.nodes[roles[0]["node"]]
        s = Stranger()
        try:
            wait_for(lambda: stats(s, old_ep, job.id)["replicated"], 60, "the backup to sync")
            t_stop = time.time()
            os.kill(agent.pid, signal.SIGSTOP)
            try:
                promoted = wait_for(lambda: [e for e in job.events(since_unix=t_stop - 1) if e["kind"] == "promote"],
                                    90, "the coordinator to promote the backup")
                first = stats(s, old_ep, job.id)
                # Anyone's push it still acknowledges (an unauthenticated one where senders are not bound).
                probe, _ = s.ask(old_ep, frames("PUSH", job.id, 0, "probe", {"rid": 9, "clock": 0, "basis": 0},
                                                {f"c{i}": np.zeros(n, dtype=np.float32) for i, n in _layout().items()}))
                time.sleep(5.0)
                try:
                    later: dict | None = stats(s, old_ep, job.id)  # type: ignore[type-arg]
                except TimeoutError:  # its serve loop may have died (a refused REPLICATE closed a socket)
                    later = None
                new = stats(s, roles[1]["endpoint"], job.id)
            finally:
                os.kill(agent.pid, signal.SIGCONT)
        finally:
            s.close()
        job.cancel()
    applied_after = None if later is None else later["updates"] - first["updates"]
    acknowledging = bool(first["primary"]) and not first.get("fenced", False)
    passed = not acknowledging and probe["op"] != "PARAMS" and applied_after == 0
    figure = (f"after the promote ({promoted[0]['message'][:60]}): isolated primary primary={first['primary']} "
              f"fenced={first.get('fenced', 'n/a')} epoch={first.get('epoch', 'n/a')}, applied "
              f"{'(no STATS answer)' if applied_after is None else applied_after} updates in the next 5 s, a probe "
              f"PUSH got {probe['op']}; promoted backup primary={new['primary']} epoch={new.get('epoch', 'n/a')}")
    return Outcome(NAME, passed, figure, {"probe": probe["meta"],
                                          "old_primary": {k: first.get(k) for k in
                                                          ("primary", "fenced", "epoch", "version", "updates")},
                                          "new_primary": {k: new.get(k) for k in ("primary", "epoch", "version")}})


if __name__ == "__main__":
    main(NAME, run)
