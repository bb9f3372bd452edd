"""Fencing pieces as pure functions: the shard lease's margin, sender tokens, the Authority meta, the agent's pipe."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from gossamer.coordinator.records import ExpRec
from gossamer.core.errors import ProtocolError
from gossamer.core.protocol import AssignmentUpdate, Authority, LeaseRenewal, shard_lease_s
from gossamer.node._role_process import drain
from gossamer.security.sender_tokens import new_key, token_for, verify


@pytest.mark.parametrize(("lease", "heartbeat", "expected"), [(10.0, 1.0, 7.5), (4.0, 0.5, 3.0), (1.0, 0.2, 0.75),
                                                              (5.0, 2.0, 3.0)])
def test_a_shard_lease_ends_a_margin_before_the_coordinator_may_call_the_node_lost(
        lease: float, heartbeat: float, expected: float) -> None:
    assert shard_lease_s(lease, heartbeat) == pytest.approx(expected)
    assert lease - shard_lease_s(lease, heartbeat) >= heartbeat


def test_a_token_proves_only_its_own_sender_under_its_own_key() -> None:
    key, other = new_key(), new_key()
    token = token_for(key, "n1:0")
    assert verify(key, "n1:0", token)
    assert not verify(key, "n2:1", token) and not verify(other, "n1:0", token)
    assert not verify(key, "n1:0", None) and not verify(key, "n1:0", token.upper())


def test_authority_meta_is_typed() -> None:
    assert Authority.from_meta("PUSH", {"auth": "ab", "epoch": 3}) == Authority(auth="ab", epoch=3)
    assert Authority.from_meta("PUSH", {}) == Authority()
    assert Authority(epoch=2).to_meta() == {"epoch": 2}
    with pytest.raises(ProtocolError, match="'auth'"):
        Authority.from_meta("PUSH", {"auth": 5})
    with pytest.raises(ProtocolError, match="'epoch'"):
        Authority.from_meta("SYNC", {"epoch": -1})


def test_assignment_update_carries_epochs_and_tokens_checked_by_type() -> None:
    upd = AssignmentUpdate(shard_epochs={0: 2}, sender_token="t", sender_key="k")
    assert AssignmentUpdate.from_dict(upd.to_dict()) == upd
    with pytest.raises(ProtocolError, match="update.shard_epochs"):
        AssignmentUpdate.from_dict({"shard_epochs": {0: "2"}})


def test_epochs_grow_per_shard_and_every_record_has_a_sender_key() -> None:
    exp = ExpRec(id="e", seq=1, name="e", spec_json="{}")
    assert exp.next_epoch(0) == 1 and exp.next_epoch(0) == 2 and exp.next_epoch(1) == 1
    again = ExpRec.from_json(exp.to_json())
    assert again.shard_epochs == {"0": 2, "1": 1} and again.sender_key == exp.sender_key
    assert len(exp.sender_key) == 64 and exp.sender_key != ExpRec(id="f", seq=2, name="f", spec_json="{}").sender_key


def test_drain_hands_lease_renewals_aside_and_a_closed_pipe_revokes_the_lease() -> None:
    recv, send = mp.Pipe(duplex=False)
    leases: list[LeaseRenewal] = []
    send.send(LeaseRenewal(until=5.0))
    send.send(AssignmentUpdate(replica=0))
    send.send(LeaseRenewal(until=6.0))
    assert drain(recv, leases.append) == AssignmentUpdate(replica=0)
    assert leases == [LeaseRenewal(until=5.0), LeaseRenewal(until=6.0)]
    send.close()
    assert drain(recv, leases.append) is None
    assert leases[-1] == LeaseRenewal(until=0.0)
