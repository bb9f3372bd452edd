"""Messages not bound to their senders: a stranger's SYNC, LEAVE, PUSH and HELLO are taken as a member's.

Issue 15: "one HELLO from anyone promotes a backup, giving two primaries; SYNC from any member
overwrites a backup; a forged LEAVE discards another worker's pending update; a forged PUSH with
a higher clock makes the real worker's updates count as duplicates, dropped yet acknowledged".
Here: coordinator, 2 on-demand nodes (primary, backup), 1 spot worker, async digits; a plain
DEALER that was never assigned anything sends, in this order:
  sync:  a SYNC (zeros, state_version 777777, sender "shard-0") to the backup;
  leave: a LEAVE under the real worker's sender id to the primary;
  push:  a PUSH under the real worker's id with clock 10**9 (zero gradients) to the primary,
         then the real worker's duplicates are counted for 5 s;
  hello: one HELLO to the backup, then the backup's STATS say whether it is primary.
PASS (each): the shard refuses the message and nothing changes.
"""

from __future__ import annotations

import time
from typing import Any

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

NAME = "unbound_messages"
FORGED_VERSION = 777_777
FORGED_CLOCK = 10**9


def _layout() -> dict[int, int]:
    from gossamer.experiment import Experiment

    return chunk_layout({}, 1, 0, Experiment.__dataclass_fields__["chunk_numel"].default)


def _effect(kind: str, ch: dict[str, Any]) -> str:
    if kind == "sync":
        return f"backup version -> {ch['backup_version_after']}"
    if kind == "leave":
        return f"victim active {ch['victim_active_before']}->{ch['victim_active_after']}"
    if kind == "push":
        return f"{ch['duplicates_in_5s']} real updates dropped as duplicates in 5 s"
    return f"backup primary={ch['backup_primary_after']}, old primary={ch['primary_still_primary']}"


def run(label: str) -> Outcome:
    checks: dict[str, dict[str, Any]] = {}
    with cluster(NAME, label) as c:
        c.add_nodes(["ps0", "ps1"], ["w0"])
        job = c.submit(digits_experiment(NAME, ps_backup=True))
        st = wait_running(job, steps=50, replicas=2)
        roles = ps_roles(st)
        primary, backup = roles[0]["endpoint"], roles[1]["endpoint"]
        zeros = {f"c{i}": np.zeros(n, dtype=np.float32) for i, n in _layout().items()}
        s = Stranger()
        try:
            wait_for(lambda: stats(s, primary, job.id)["replicated"], 60, "the backup to sync")
            victim = wait_for(lambda: sorted(stats(s, primary, job.id)["applied"]), 30, "a worker's update")[0]

            head, _ = s.ask(backup, frames("SYNC", job.id, 0, "shard-0",
                                           {"rid": 1, "state_version": FORGED_VERSION, "applied": {}, "scalars": {}},
                                           zeros, version=FORGED_VERSION))
            version = stats(s, backup, job.id)["version"]
            checks["sync"] = {"reply": head["op"], "error": head["meta"].get("error", ""),
                              "backup_version_after": version,
                              "passed": head["op"] == "ERROR" and version != FORGED_VERSION}

            before = stats(s, primary, job.id)
            head, _ = s.ask(primary, frames("LEAVE", job.id, 0, victim, {"rid": 2}))
            after = stats(s, primary, job.id)
            checks["leave"] = {"reply": head["op"], "error": head["meta"].get("error", ""), "victim": victim,
                               "victim_active_before": victim in before["active"],
                               "victim_active_after": victim in after["active"],
                               "passed": head["op"] == "ERROR"}

            dup0 = stats(s, primary, job.id)["discarded"].get("duplicate", 0)
            head, _ = s.ask(primary, frames("PUSH", job.id, 0, victim,
                                            {"rid": 3, "clock": FORGED_CLOCK, "basis": 0}, zeros))
            time.sleep(5.0)
            later = stats(s, primary, job.id)
            dups = later["discarded"].get("duplicate", 0) - dup0
            checks["push"] = {"reply": head["op"], "error": head["meta"].get("error", ""),
                              "victim_applied_clock": later["applied"].get(victim),
                              "duplicates_in_5s": dups, "passed": head["op"] == "ERROR" and dups == 0}

            head, _ = s.ask(backup, frames("HELLO", job.id, 0, "stranger", {"rid": 4, "fresh": True}))
            time.sleep(1.0)
            b = stats(s, backup, job.id)
            p = stats(s, primary, job.id)
            checks["hello"] = {"reply": head["op"], "error": head["meta"].get("error", ""),
                               "backup_primary_after": b["primary"], "primary_still_primary": p["primary"],
                               "passed": head["op"] == "ERROR" and not b["primary"]}
        finally:
            s.close()
        job.cancel()
    passed = all(ch["passed"] for ch in checks.values())
    figure = "; ".join(f"{k}: {'refused' if ch['passed'] else 'TAKEN'} ({ch['reply']}, {_effect(k, ch)})"
                       for k, ch in checks.items())
    return Outcome(NAME, passed, figure, checks)


if __name__ == "__main__":
    main(NAME, run)
