"""Kills landing exactly inside an exchange: mid local all-reduce, mid-push, mid-pull, mid checkpoint write.

Survivors never crash or hang, a partial update is discarded (and counted), never applied.
"""

from __future__ import annotations

import pytest

from gossamer import Client
from tests._fixtures import MakeCluster, ranks_env
from tests.chaos._wait import wait_for

pytestmark = pytest.mark.timeout(420)



def test_kills_mid_exchange_never_crash_or_hang_a_survivor(tmp_path, make_cluster: MakeCluster) -> None:  # type: ignore[no-untyped-def]
    once = tmp_path / "once"
    once.mkdir()

    def fault(spec: str, name: str, extra: str = "") -> dict[str, str]:
        return {"GOSSAMER_FAULT": f"{spec}:once={once / name}{extra}"}

    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        # The primary dies while writing a checkpoint (files written, not yet renamed), the first
        # one after the "push" node's held half was discarded (below): with the primary gone
        # first, the held half went with it and the discard was never seen (a quiet machine).
        discarded = tmp_path / "discarded"
        cluster.add_node("ps-a", env=fault("die:at=mid-checkpoint:step=200", "ckpt", f":after={discarded}"))
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps-a")
        cluster.add_node("ps-b")
        # Two local ranks: rank 1 dies inside the gradient all-reduce; rank 0 is left in it.
        cluster.add_node("allreduce", spot=True, nproc_per_node=2,
                         env=fault("die:at=mid-allreduce:step=20:rank=1", "allreduce") | ranks_env(2))
        # Two local ranks: rank 1 dies before sending its part, rank 0's part reached the shard.
        cluster.add_node("push", spot=True, nproc_per_node=2, env=fault("die:at=mid-push:step=30:rank=1", "push") | ranks_env(2))
        # The push is sent (and applied), the process dies before reading the reply. This node
        # is slowed down so that training lasts until the two-rank workers are up.
        cluster.add_node("pull", spot=True, env=fault("die:at=mid-pull:step=40", "pull", ",delay:seconds=0.02"))
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 5, 90, "five nodes")
        job = client.submit({
            "name": "mid-exchange", "model": "gossamer.examples.digits:mlp",
            "dataset": "gossamer.examples.digits:data", "mode": "async", "lr": 0.05, "momentum": 0.5,
            "num_ps_shards": 1, "min_workers": 3, "max_workers": 3, "total_steps": 3000,
            "eval_every": 500, "checkpoint_every": 200, "chunk_numel": 512,
        })
        wait_for(lambda: any(e["kind"] == "discard" and "cause partial" in e["message"] for e in job.events()),
                 240, "the push node's held half discarded")
        assert job.status()["state"] == "running" and not (once / "ckpt").exists()  # the primary's death is yet to come
        discarded.touch()
        result = job.wait(timeout=360)
        events = job.events()
        nodes = {n["name"]: n for n in client.nodes()}
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert result.metrics["eval_accuracy"] >= 0.9, (result.metrics, text)
    assert sorted(p.name for p in once.iterdir()) == ["allreduce", "ckpt", "pull", "push"], text  # all fired
    for name in ("allreduce", "push", "pull"):  # a dead rank is a lost worker; the node lives on
        assert any(e["kind"] == "lost" and f"on {name} failed" in e["message"] for e in events), (name, text)
        assert nodes[name]["state"] != "lost"
    assert any(e["kind"] == "promote" and "primary on ps-a gone" in e["message"] for e in events), text
    # rank 0's half of the "push" node's update was held, then discarded when the worker was dropped
    assert result.metrics.get("discarded_partial", 0) >= 1, (result.metrics, text)
    assert any(e["kind"] == "discard" and "cause partial" in e["message"] for e in events), text
    ckpts = sorted(p.name for p in (tmp_path / "state" / "checkpoints" / job.id / "shards").iterdir())
    assert all(not n.startswith(".") or ".tmp-" in n for n in ckpts)
