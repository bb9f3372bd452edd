"""compression="adaptive": a throttled link makes it compress harder within a few steps, and relax after."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gossamer.core.experiment import Experiment
from gossamer.engine.rank import RankContext
from gossamer.training.shards.ps_trainer import ParameterServerTrainer
from gossamer.transport.throttle import TokenBucket
from tests.integration._ps_harness import Shards

pytestmark = pytest.mark.timeout(300)


def test_adaptive_follows_the_link_bandwidth_down_and_back_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    exp = Experiment(name="adaptive", model="gossamer.examples.digits:mlp", dataset="gossamer.examples.digits:data",
                     mode="async", lr=0.05, momentum=0.9, num_ps_shards=1, total_steps=10**6, eval_every=0,
                     batch_size=1024,  # compute per step well above a fast link's transfer, even on a loaded machine
                     compression="adaptive")
    shards = Shards(exp)
    throttle = TokenBucket(rate_bps=None, burst_bytes=8 * 1024)
    trainer = ParameterServerTrainer(RankContext(experiment_id="e", experiment=exp, node_id="n", worker_index=0, num_workers=1,
                                  endpoints=shards.endpoints, checkpoint_dir=str(tmp_path), throttle=throttle))
    assert trainer.adaptive is not None
    stop = threading.Event()
    trainer.should_stop = stop.is_set
    thread = threading.Thread(target=trainer.run)
    thread.start()
    level = trainer.adaptive.policy.mean_level

    def settled_level(seconds: float) -> float:
        # The level the policy settles at on the fast link: the lowest seen over the phase, since
        # on a loaded machine two stalled probes in a row read as a real drop for a moment.
        lowest, deadline = level(), time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
            lowest = min(lowest, level())
        return lowest

    try:
        fast = settled_level(4.0)
        throttle.set_rate(2e5)  # 1.6 Mbit/s: even an int8 push takes a hundred times the compute
        steps_at_throttle = trainer.stats.steps
        deadline = time.monotonic() + 30
        while level() <= fast and time.monotonic() < deadline:
            time.sleep(0.05)
        slow, steps_to_react = level(), trainer.stats.steps - steps_at_throttle
        throttle.set_rate(None)
        deadline = time.monotonic() + 30
        while level() > fast and time.monotonic() < deadline:
            time.sleep(0.05)
        relaxed = level()
        bytes_before = trainer.client.bytes_up
        time.sleep(1.0)
        assert trainer.stats.steps > 0 and trainer.client.bytes_up > bytes_before  # still training
    finally:
        stop.set()
        thread.join(60)
        shards.close()
    print(f"adaptive level fast={fast:.2f} throttled={slow:.2f} ({steps_to_react} steps) relaxed={relaxed:.2f}")
    assert slow > fast, (fast, slow)
    assert steps_to_react <= 25, f"took {steps_to_react} steps to react to the throttle"
    # Back to (at most) the unthrottled aggressiveness. The unthrottled choice itself depends
    # on the machine: a loaded 2-core VM measures loopback at 45-500 MB/s.
    assert relaxed <= fast, (fast, slow, relaxed)
    metrics = trainer.adaptive.metrics()
    assert metrics["adaptive_changes"] >= 2 and any(k.startswith("codec_level.") for k in metrics)
    assert metrics["adaptive_probes"] >= 2
