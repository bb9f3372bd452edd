"""Unbounded queues: a peer that sends small PULLs and never reads makes the shard queue a full copy per reply.

Issue 15: "300 MB for 300 replies of 1 MB". Here: one shard of a 1.1M-parameter MLP (4.5 MB),
a stranger sends 300 PULLs over 10 DEALERs that never read (10 connections: a new connection
starts a new rate-limit bucket). PASS: the shard process grows by less than 64 MB.
"""

from __future__ import annotations

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
    wait_running,
)

NAME = "unbounded_queues"
MODEL = {"hidden": 1024}
BOUND = 64 << 20


def run(label: str) -> Outcome:
    with cluster(NAME, label) as c:
        c.add_nodes(["ps"], ["w0"])
        job = c.submit(digits_experiment(NAME, model_args=MODEL))
        st = wait_running(job, steps=20)
        endpoint = ps_roles(st)[0]["endpoint"]
        pid = pid_listening_on(port_of(endpoint))
        stranger = Stranger()
        try:
            got = flood(stranger, pid, endpoint,
                        lambda i: frames("PULL", job.id, 0, f"stranger-{i % 10}", {"rid": i}), total=300, sockets=10)
        finally:
            stranger.close()
        job.cancel()
    grew = got["growth_bytes"]
    figure = (f"shard grew {'over ' if got['stopped_at_limit'] else ''}{mb(grew)} for {got['sent']} unread PULLs "
              f"({got['seconds']:.0f}s; bound {mb(BOUND)})")
    return Outcome(NAME, grew < BOUND, figure, got)


if __name__ == "__main__":
    main(NAME, run)
