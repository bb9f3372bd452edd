"""`gossamer demo`: a coordinator, two shards and three workers on this machine, training digits async."""

from __future__ import annotations

import importlib.util
import tempfile
import time

from gossamer.core.errors import MissingExtraError
from gossamer.core.experiment import Experiment
from gossamer.tools.client import Client
from gossamer.tools.local_cluster import LocalCluster
from gossamer.tools.watch import follow


def demo_experiment(workers: int, shards: int, total_steps: int) -> Experiment:
    return Experiment(
        name="digits-async",
        model="gossamer.examples.digits:mlp",
        dataset="gossamer.examples.digits:data",
        mode="async",
        optimizer="sgd", lr=0.1, lr_schedule="cosine", momentum=0.5, batch_size=32,
        staleness=4, num_ps_shards=shards, min_workers=workers, max_workers=workers,
        total_steps=total_steps, eval_every=100, checkpoint_every=500, seed=0,
    )


def run_demo(workers: int = 3, shards: int = 2, total_steps: int = 1500, keep: bool = False) -> int:
    """Run the demo to its end; the exit code of following the run.

    Raises:
        MissingExtraError: scikit-learn (the digits data) is not installed; said before anything starts.
    """
    if importlib.util.find_spec("sklearn") is None:
        raise MissingExtraError("scikit-learn", "examples", "gossamer demo (the digits data)")
    state = tempfile.mkdtemp(prefix="gossamer-demo-") if keep else None
    t0 = time.monotonic()
    with LocalCluster(state) as cluster:
        print(f"coordinator: starting (state in {cluster.state_dir})")
        address = cluster.start_coordinator(port=0)
        print(f"coordinator: serving on {address}")
        for i in range(shards):
            cluster.add_node(f"ondemand-{i}")
        for i in range(workers):
            cluster.add_node(f"spot-{i}", spot=True)
        print(f"nodes: {shards} on-demand (they will host the shards), {workers} spot (workers); "
              f"logs in {cluster.log_dir}")
        client = Client(address)
        deadline = time.monotonic() + 60
        while len([n for n in client.nodes() if n["state"] == "ready"]) < shards + workers:
            if time.monotonic() > deadline:
                print("nodes did not join within 60 s; see the logs")
                return 1
            time.sleep(0.2)
        job = client.submit(demo_experiment(workers, shards, total_steps))
        print(f"submitted {job.id}: digits MLP, async SGD, {shards} shards x {workers} workers, "
              f"{total_steps} steps")
        code = follow(job)
        result = job.wait(timeout=10)
        m = result.metrics
        print(f"samples {m.get('samples', 0):.0f}, bytes up {m.get('bytes_up', 0) / 1e6:.1f} MB, "
              f"down {m.get('bytes_down', 0) / 1e6:.1f} MB, wall {time.monotonic() - t0:.0f} s")
        print("your own model on a cluster like this one: `gossamer local up`, then "
              "`gossamer submit YOUR.toml --local --wait` (docs/quickstart.md)")
        if not keep:
            print("(the demo's state, logs and checkpoint are removed on exit; `gossamer demo --keep` keeps them)")
        client.close()
    return code
