"""Fault specs are parsed once per spec string, and a changed $GOSSAMER_FAULT takes effect at once."""

from __future__ import annotations

import pytest

from gossamer.core.faults import InjectedFault, fail_at, fault, gate_at, parse_faults


def test_parsed_faults_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOSSAMER_FAULT", raising=False)
    fail_at("serve-loop", step=10**6, shard=0)  # no faults: nothing fires
    monkeypatch.setenv("GOSSAMER_FAULT", "fail:at=serve-loop:step=3:shard=1")
    fail_at("serve-loop", step=2, shard=1)  # before its step
    fail_at("serve-loop", step=3, shard=0)  # another shard
    with pytest.raises(InjectedFault):
        fail_at("serve-loop", step=3, shard=1)
    monkeypatch.setenv("GOSSAMER_FAULT", "fail:at=serve-loop:step=5")
    fail_at("serve-loop", step=3, shard=1)  # the new spec, not the cached old one
    with pytest.raises(InjectedFault):
        fail_at("serve-loop", step=5, shard=1)


def test_callers_get_their_own_copies() -> None:
    spec = "delay:seconds=0.5:worker=1,die:at=mid-push"
    first = parse_faults(spec)
    assert first == [("delay", {"seconds": "0.5", "worker": "1"}), ("die", {"at": "mid-push"})]
    first[0][1]["seconds"] = "9"  # a caller changing its result does not change the next one
    assert parse_faults(spec)[0][1]["seconds"] == "0.5"


def test_fault_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOSSAMER_FAULT", "delay:seconds=0.25:worker=2")
    assert fault("delay", worker=2) == {"seconds": "0.25", "worker": "2"}
    assert fault("delay", worker=1) is None


def test_a_fault_with_after_waits_for_its_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    flag = tmp_path / "far-enough"
    monkeypatch.setenv("GOSSAMER_FAULT", f"fail:at=serve-loop:step=3:after={flag}")
    fail_at("serve-loop", step=10)  # past its step, but the run has not got far enough yet
    flag.touch()
    with pytest.raises(InjectedFault):
        fail_at("serve-loop", step=10)


def test_a_gate_holds_its_thread_from_its_step_until_its_file_exists(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path) -> None:  # type: ignore[no-untyped-def]
    import threading

    gate = tmp_path / "open"
    monkeypatch.setenv("GOSSAMER_FAULT", f"gate:at=push:step=5:until={gate}:worker=1")
    gate_at("push", step=4, worker=1)  # before its step: passes
    gate_at("push", step=9, worker=0)  # another worker: passes
    passed = threading.Event()
    held = threading.Thread(target=lambda: (gate_at("push", step=5, worker=1), passed.set()))
    held.start()
    assert not passed.wait(0.5)  # held while the file is missing
    gate.touch()
    assert passed.wait(30)
    held.join()
