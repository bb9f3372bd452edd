"""Every replica of a shard lost: it is restored from the newest *good* sharded checkpoint and training goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gossamer import Client
from gossamer.checkpoint.sharded import complete_steps
from tests._fixtures import MakeCluster
from tests.chaos._wait import assert_running, wait_for, wait_steps

pytestmark = pytest.mark.timeout(300)



def _flip_a_bit(step: Path) -> Path:
    data = next(p for p in sorted(step.rglob("*.distcp")))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    data.write_bytes(bytes(blob))
    return data


def test_unreplicated_shard_lost_restores_from_previous_good_checkpoint(tmp_path: Path, make_cluster: MakeCluster) -> None:
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        cluster.add_node("w0", spot=True)
        cluster.add_node("w1", spot=True)
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 3, 60, "nodes")
        job = client.submit({
            "name": "restore", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
            "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 1, "ps_backup": False,
            "min_workers": 2, "max_workers": 2, "total_steps": 4000, "eval_every": 500, "checkpoint_every": 250,
        })
        root = tmp_path / "state" / "checkpoints" / job.id / "shards"
        wait_for(lambda: root.exists() and len(complete_steps(root)) >= 2, 120, "two checkpoints")
        cluster.kill_node("ps")
        assert_running(job, "the kill of ps")
        newest, previous = complete_steps(root)[:2]
        _flip_a_bit(newest)  # on disk, after the fact: only the checksum can tell
        result = job.wait(timeout=240)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert result.metrics["eval_accuracy"] >= 0.9, (result.metrics, text)
    assert any(e["kind"] == "restore" and "every replica gone" in e["message"] for e in events), text
    restored = next(e["message"] for e in events if e["kind"] == "restored")
    # The corrupt newest checkpoint was refused; the one before it was used.
    assert f"from {previous}" in restored or f"from {previous.resolve()}" in restored, (restored, newest, previous)
    # Exactly counted by the restored shard from each worker's next clock, and logged.
    assert result.metrics["versions_lost"] > 0, (result.metrics, text)
    assert result.metrics["versions_lost"] >= result.metrics["versions_lost_min"]
    assert any(e["kind"] == "lost-updates" for e in events), text
    assert result.metrics["restores"] == 1


def _no_checkpoint_run(client: Client) -> Any:
    return client.submit({
        "name": "no-source", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
        "mode": "async", "num_ps_shards": 1, "ps_backup": False, "min_workers": 1, "max_workers": 1,
        "total_steps": 600, "eval_every": 0,
    })


def _restored_event(events: list[dict[str, Any]]) -> tuple[str, int, int]:
    """The `restored` event: (its text, the version restored, its '[at least] N version(s) lost')."""
    text = next(e["message"] for e in events if e["kind"] == "restored")
    version = int(text.split(" at version ")[1].split(";")[0])
    lost = re.search(r"; (?:at least )?(\d+) version\(s\) lost", text)
    assert lost is not None, text
    return text, version, int(lost.group(1))


def test_shard_lost_with_no_checkpoint_is_rebuilt_from_the_freshest_workers_copy(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    # 1 shard, no backup, no checkpoints, its node killed at 30%. Without the rebuild it restarted
    # from initial values while the run went on, and `versions_lost` read 0. The
    # worker holds the values it last pulled: the shard is rebuilt from them.
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        cluster.add_node("w0", spot=True, env={"GOSSAMER_FAULT": "delay:seconds=0.02"})
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 2, 60, "nodes")
        job = _no_checkpoint_run(client)
        wait_steps(job, 180, 120, "30% of the steps")
        cluster.kill_node("ps")
        assert_running(job, "the kill of ps")
        result = job.wait(timeout=180)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "completed", (result, text)
    assert any(e["kind"] == "restore" and "freshest worker's copy" in e["message"] for e in events), text
    restored, version, lost = _restored_event(events)
    assert "restored from worker " in restored and "'s copy" in restored, restored
    assert version >= 180, restored  # the worker's copy, not the initial values
    assert result.metrics["versions_lost"] == lost, (result.metrics, restored)  # the event and the metric agree


def test_shard_lost_with_no_source_at_all_fails_the_run_saying_why(tmp_path: Path, make_cluster: MakeCluster) -> None:
    # No checkpoint, and the worker lost with the shard: the new worker's copy is the initial values.
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        cluster.add_node("ps")
        wait_for(lambda: len(client.nodes()) == 1, 60, "ps")
        cluster.add_node("w0", spot=True, env={"GOSSAMER_FAULT": "delay:seconds=0.02"})
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 2, 60, "nodes")
        job = _no_checkpoint_run(client)
        wait_steps(job, 180, 120, "30% of the steps")
        cluster.kill_node("ps")
        cluster.kill_node("w0")
        assert_running(job, "the kills")
        cluster.add_node("n2", env={"GOSSAMER_FAULT": "delay:seconds=0.02"})
        result = job.wait(timeout=180)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert result.status == "failed", (result, text)
    assert "shard 0 lost every replica, no checkpoint was found" in result.message, result
    assert "no worker held a newer copy" in result.message, result
    _, version, lost = _restored_event(events)
    assert version == 0 and lost > 0, text  # a lower bound: the shard reports its version once a second
    assert result.metrics["versions_lost"] == lost, (result.metrics, text)
    assert f"would lose {lost} version(s)" in result.message, result


def test_shard_lost_on_a_host_without_its_checkpoint_fetches_the_files_from_the_node_that_holds_them(
        tmp_path: Path, make_cluster: MakeCluster) -> None:
    # Each node writes checkpoints to its own disk (--checkpoint-dir): no host ever holds a
    # complete step of a 2-shard run. Shard 1's process fails on its node (which lives on);
    # shard 1 is restored on the other shard's node, which has shard 0's files only. Before,
    # it found no checkpoint there and was rebuilt from the worker's copy (no optimizer state).
    disks = {name: tmp_path / f"disk-{name}" for name in ("ps-a", "ps-b", "w0")}
    once = tmp_path / "serve-loop-failed"
    fault = f"fail:at=serve-loop:step=450:shard=1:once={once}"  # whichever node hosts shard 1, once
    with make_cluster(state_dir=tmp_path / "state") as cluster:
        client = Client(cluster.start_coordinator(port=0))
        for name in ("ps-a", "ps-b"):
            cluster.add_node(name, env={"GOSSAMER_CHECKPOINT_DIR": str(disks[name]), "GOSSAMER_FAULT": fault})
        wait_for(lambda: len(client.nodes()) == 2, 60, "the shard nodes")
        cluster.add_node("w0", spot=True, env={"GOSSAMER_CHECKPOINT_DIR": str(disks["w0"])})
        wait_for(lambda: sum(n["state"] == "ready" for n in client.nodes()) == 3, 60, "nodes")
        job = client.submit({
            "name": "fetch", "model": "gossamer.examples.digits:mlp", "dataset": "gossamer.examples.digits:data",
            "mode": "async", "lr": 0.05, "momentum": 0.5, "num_ps_shards": 2, "ps_backup": False,
            "min_workers": 1, "max_workers": 1, "total_steps": 1000, "eval_every": 0, "checkpoint_every": 100,
            "chunk_numel": 512,
        })

        def shard_1_lost() -> str:
            return next((e["message"] for e in job.events() if e["kind"] == "lost"
                         and e["message"].startswith("parameter_server 1 on ")), "")

        wait_for(shard_1_lost, 180, "shard 1's process failing")
        lost = shard_1_lost()
        holder = lost.split(" on ")[1].split(" ")[0]
        restorer = next(n for n in ("ps-a", "ps-b") if n != holder)
        # Shard 1 writes no more on the holder: the newest step its files and shard 0's on the
        # restorer complete is the one to restore (shard 0 may have skipped a busy save).
        held = disks[holder] / job.id / "shards"
        own = disks[restorer] / job.id / "shards"
        newest = max(p.parent.parent for p in held.glob("step-*/shard-001/manifest.json")
                     if (own / p.parent.parent.name / "shard-000" / "manifest.json").is_file())
        version = json.loads((newest / "shard-001" / "manifest.json").read_text())["version"]
        result = job.wait(timeout=240)
        events = job.events()
    text = "\n".join(f"{e['kind']}: {e['message']}" for e in events)
    assert once.exists(), text
    assert result.status == "completed", (result, text)
    restored, at, lost_min = _restored_event(events)
    # From the holder's newest checkpoint, fetched: not the worker's copy, not the initial values.
    assert restored.startswith(f"shard 1 restored from {disks[restorer] / job.id / 'shards' / newest.name} "), \
        (restored, newest)
    assert f"fetched shard(s) [1] of checkpoint step {int(newest.name[5:])} from tcp://" in restored, restored
    assert at == version >= 100, (restored, version)  # every version the checkpoint held is kept
    assert not any("worker's copy" in e["message"] for e in events), text
    assert result.metrics["versions_lost"] >= lost_min, (result.metrics, restored)
    assert result.metrics["restores"] == 1
