"""Replication lost for good after one stall: a backup detached after a 3 s stall is never re-attached.

Issue 15: "a backup detached after a 3 s stall is never re-attached; if the primary is lost later,
the coordinator restores from a checkpoint or from initial values although the backup is alive".
Here: coordinator, 2 on-demand nodes (primary, backup) and 1 spot worker, async digits. The
backup's role process is stopped (SIGSTOP) for 6 s while the worker trains, then continued.
PASS: the primary reports `replicated` again within 60 s of the SIGCONT, and after the primary's
node is then killed (kill -9) the coordinator promotes the backup (no restore).
"""

from __future__ import annotations

import os
import signal
import time

from _common import (
    Outcome,
    Stranger,
    cluster,
    digits_experiment,
    main,
    pid_listening_on,
    port_of,
    ps_roles,
    stats,
    wait_for,
    wait_running,
)

NAME = "backup_stall"
STOP_S = 6.0
RESYNC_S = 60.0


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        c.add_nodes(["ps0", "ps1"], ["w0"])
        job = c.submit(digits_experiment(NAME, ps_backup=True))
        st = wait_running(job, steps=50, replicas=2)
        roles = ps_roles(st)
        primary_ep, backup_ep = roles[0]["endpoint"], roles[1]["endpoint"]
        backup_pid = pid_listening_on(port_of(backup_ep))
        stranger = Stranger()
        try:
            wait_for(lambda: stats(stranger, primary_ep, job.id)["replicated"], 60, "the backup to sync first")
            os.kill(backup_pid, signal.SIGSTOP)
            try:
                detached = wait_for(lambda: stats(stranger, primary_ep, job.id)["backup_detaches"] >= 1,
                                    STOP_S + 20, "the stopped backup to be detached")
                time.sleep(STOP_S)
            finally:
                os.kill(backup_pid, signal.SIGCONT)
            continued = time.monotonic()
            try:
                wait_for(lambda: stats(stranger, primary_ep, job.id)["replicated"], RESYNC_S, "a re-sync")
                resynced = round(time.monotonic() - continued, 1)
            except TimeoutError:
                resynced = None
            after = stats(stranger, primary_ep, job.id)
        finally:
            stranger.close()
        # The consequence: the primary's node is lost while the backup process is alive.
        t_kill = time.time()
        c.lc.kill_node(roles[0]["node"])

        def recovery() -> list[dict] | None:  # type: ignore[type-arg]
            ev = [e for e in job.events(since_unix=t_kill - 1) if e["kind"] in ("promote", "restore", "restored")]
            return ev or None

        try:
            events = wait_for(recovery, 90, "the coordinator to promote or restore")
        except TimeoutError:
            events = []
        job.cancel()
    first = events[0] if events else {"kind": "none", "message": "no promote/restore event in 90 s"}
    passed = resynced is not None and first["kind"] == "promote"
    figure = (f"detached={bool(detached)}; {'re-synced ' + str(resynced) + ' s' if resynced is not None else 'not re-synced'}"
              f" after SIGCONT (waited {RESYNC_S:.0f} s); primary then killed -> {first['kind']}: "
              f"{first['message'][:110]}")
    return Outcome(NAME, passed, figure, {"stats_after": {k: after.get(k) for k in
                                                          ("replicated", "backup_detaches", "unreplicated",
                                                           "resyncs", "version")},
                                          "events": events})


if __name__ == "__main__":
    main(NAME, run)
