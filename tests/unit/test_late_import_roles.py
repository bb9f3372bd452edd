"""Which roles have their node's fork server import dynamo and DCP before they fork (`agent._needs_late`)."""

from __future__ import annotations

import json

import pytest

from gossamer.core.modes import MODES, resolve
from gossamer.node.agent import _needs_late
from gossamer.v1 import coordinator_pb2 as pb


def _worker(**fields: object) -> pb.Assignment:
    return pb.Assignment(role=pb.ROLE_WORKER, experiment_json=json.dumps(fields))


def test_a_shard_always_needs_them() -> None:
    assert _needs_late(pb.Assignment(role=pb.ROLE_PARAMETER_SERVER, experiment_json="{}"))


@pytest.mark.parametrize("mode,outer_step,needs", [("async", "", False), ("sync", "", False), ("gossip", "", True),
                                                   ("diloco", "sync", True), ("diloco", "gossip", True)])
def test_a_worker_needs_them_when_it_steps_an_optimizer_of_its_own(mode: str, outer_step: str, needs: bool) -> None:
    assert bool(_needs_late(_worker(mode=mode, outer_step=outer_step))) is needs


def test_the_mode_table_says_which_workers_build_an_optimizer() -> None:
    own = {m for m in MODES if any(resolve(m, s).worker_optimizer for s in ("", "sync", "async", "gossip")
                                   if _row(m, s))}
    assert own == {"gossip", "diloco"}


def _row(mode: str, outer_step: str) -> bool:
    try:
        resolve(mode, outer_step)
    except KeyError:
        return False
    return True


@pytest.mark.parametrize("doc", ["not json", "[]", json.dumps({"mode": "nope"}), json.dumps({})])
def test_an_experiment_it_cannot_read_forks_at_once(doc: str) -> None:
    assert _needs_late(pb.Assignment(role=pb.ROLE_WORKER, experiment_json=doc)) == ""
