"""A copy per invented sender: with a pull codec, a PULL from any sender id keeps a clone of the whole shard.

Issue 15: "50 fake PULLs kept 191 MB" and "3,000 PULLs with pull_codec int8 from invented senders
on 40 sockets that never read, at the shard of a 1.1M-parameter model, grew the shard host's
memory by 9.5 GB in 25 s". Here, on one shard of a 1.1M-parameter MLP (4.5 MB):
(a) 50 PULLs with pull_codec int8, one invented sender each, every reply read; growth of the
shard process 5 s later. PASS: under 48 MB (ten copies).
(b) 3,000 such PULLs over 40 DEALERs that never read, stopped once the shard grew 1 GB.
PASS: under 64 MB.
"""

from __future__ import annotations

import time

from _common import (
    Outcome,
    Stranger,
    cluster,
    digits_experiment,
    flood,
    frames,
    main,
    mb,
    pid_listening_on,
    port_of,
    ps_roles,
    rss_bytes,
    stats,
    wait_running,
)

NAME = "pull_views"
MODEL = {"hidden": 1024}
KEPT_BOUND = 48 << 20
FLOOD_BOUND = 64 << 20


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        c.add_nodes(["ps"], ["w0"])
        job = c.submit(digits_experiment(NAME, model_args=MODEL))
        st = wait_running(job, steps=20)
        endpoint = ps_roles(st)[0]["endpoint"]
        pid = pid_listening_on(port_of(endpoint))
        stranger = Stranger()
        try:
            base = rss_bytes(pid)
            answers: dict[str, int] = {}
            for i in range(50):
                head, _ = stranger.ask(endpoint, frames("PULL", job.id, 0, f"invented-{i}",
                                                        {"rid": i, "pull_codec": "int8"}))
                answers[head["op"]] = answers.get(head["op"], 0) + 1
            time.sleep(5.0)
            kept = rss_bytes(pid) - base
            views = stats(stranger, endpoint, job.id).get("pull_views", "n/a")
            got = flood(stranger, pid, endpoint,
                        lambda i: frames("PULL", job.id, 0, f"flood-{i}", {"rid": i, "pull_codec": "int8"}),
                        total=3000, sockets=40)
        finally:
            stranger.close()
        job.cancel()
    passed = kept < KEPT_BOUND and got["growth_bytes"] < FLOOD_BOUND
    figure = (f"50 fake int8 PULLs kept {mb(kept)} (replies {answers}); 3,000 unread: shard grew "
              f"{'over ' if got['stopped_at_limit'] else ''}{mb(got['growth_bytes'])} after {got['sent']} in "
              f"{got['seconds']:.0f}s")
    return Outcome(NAME, passed, figure, {"kept_bytes": kept, "replies": answers, "pull_views": views,
                                          "flood": got})


if __name__ == "__main__":
    main(NAME, run)
