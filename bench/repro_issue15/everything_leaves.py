"""Everything leaves -> FAILED: when all nodes leave, the experiment is failed for good although checkpoints exist.

Issue 15: "when all nodes leave, the experiment is failed for good although checkpoints exist".
Here: 1 on-demand node (the shard) and 1 spot worker, async digits with a checkpoint every 100
steps; once a checkpoint is registered both nodes leave (SIGTERM: a graceful leave), and 20 s
later two new nodes join.
PASS: the experiment is not failed while no node is there, and it resumes (its steps grow past
the checkpoint's) within 180 s of the new nodes joining.
"""

from __future__ import annotations

import time

from _common import Outcome, cluster, digits_experiment, main, wait_for, wait_running

NAME = "everything_leaves"
SLOW = {"GOSSAMER_FAULT": "delay:seconds=0.02"}


def run(label: str) -> Outcome:
    return leave_and_return(label, NAME)


def leave_and_return(label: str, name: str, shard_host_env: dict[str, str] | None = None) -> Outcome:
    """All nodes leave after a checkpoint; 20 s later a shard node (with `shard_host_env`) and a worker node join."""
    with cluster(name, label) as c:
        c.lc.add_node("ps0")
        c.wait_nodes(1)
        c.lc.add_node("w0", spot=True, env=SLOW)
        c.wait_nodes(2)
        job = c.submit(digits_experiment(name, checkpoint_every=100, total_steps=200_000))
        wait_running(job, steps=1)
        # Periodic checkpoints are the shard's: an event each (the status names the final one only).
        ckpts = wait_for(lambda: [e for e in job.events() if e["kind"] == "checkpoint"], 240, "a checkpoint")
        checkpoint = ckpts[-1]["message"]
        for node in ("w0", "ps0"):
            c.lc.stop_node(node)
        time.sleep(20.0)
        gone = job.status()
        c.lc.add_node("ps1", env=shard_host_env)
        c.wait_nodes(1)
        c.lc.add_node("w1", spot=True, env=SLOW)
        floor = gone["steps"]

        def resumed() -> dict | None:  # type: ignore[type-arg]
            s = job.status()
            if s["state"] in ("failed", "cancelled", "completed"):
                return s
            return s if s["state"] == "running" and s["steps"] > floor + 50 else None

        try:
            back = wait_for(resumed, 180, "the experiment to resume")
        except TimeoutError:
            back = job.status()
        job.cancel()
    passed = gone["state"] != "failed" and back["state"] == "running" and back["steps"] > floor + 50
    figure = (f"all nodes left after checkpoint {checkpoint.split(':')[0]}: {gone['state']} "
              f"({gone['message'][:80]}); nodes back: {back['state']} at step {back['steps']}")
    return Outcome(name, passed, figure, {"checkpoint": checkpoint, "while_gone": gone["message"],
                                          "after": back["message"]})


if __name__ == "__main__":
    main(NAME, run)
